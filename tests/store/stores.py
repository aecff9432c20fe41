"""One way to open a disk store in tests, and what tests do to one from outside.

- `open_store(path, capacity, **kw)`: a `DiskStore` on `path` (keywords go to `StoreConfig`, or to
  `DiskStore` for its own: `STORE_ARGS`); the `disk_store`/`open_disk` fixtures of
  tests/store/conftest.py use it and close what they opened.
- `worker(mode, directory, **opts)`: tests/store/worker.py as another process on the directory.
- `index_rows`, `damage_index`, `corrupt_block`: read the index, wreck it, or flip a byte of one
  block on disk, as another program could.
- `small_tmpfs(mnt, size)`: a real small tmpfs (root only; skips elsewhere) for a real ENOSPC.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sqlite3
import subprocess
import sys
from typing import Iterator

import pytest

from offload.config import Size, StoreConfig
from offload.store.disk.slab import format as slot_format
from offload.store.disk.slab import pagecache
from offload.store.disk.store import DiskStore

WORKER = os.path.join(os.path.dirname(__file__), "worker.py")


STORE_ARGS = ("lock_timeout_s", "max_open_slabs", "free_bytes", "pending_bytes", "gate")


def open_store(path, capacity=1 << 30, min_free=0, **kw) -> DiskStore:
    """A DiskStore on `path` (no free-space floor unless `min_free`); keyword arguments go to
    StoreConfig, or to DiskStore for its own (`STORE_ARGS`)."""
    own = {k: kw.pop(k) for k in STORE_ARGS if k in kw}
    return DiskStore(StoreConfig(path=str(path), capacity=Size(capacity), min_free=Size(min_free),
                                 **kw), **own)


def index_rows(directory, table: str = "blocks") -> int:
    """Rows of one table of the store's index, read by a connection of the test's own."""
    db = sqlite3.connect(os.path.join(directory, "index.db"))
    try:
        return db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    finally:
        db.close()


def worker(mode: str, directory, **opts) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WORKER, mode, str(directory), json.dumps(opts)],
                            stdout=subprocess.PIPE, text=True)


def damage_index(d) -> None:
    for suffix in ("-wal", "-shm"):
        if os.path.exists(f"{d}/index.db{suffix}"):
            os.unlink(f"{d}/index.db{suffix}")
    with open(d / "index.db", "r+b") as f:
        f.write(os.urandom(4096))


@contextlib.contextmanager
def small_tmpfs(mnt, size: str) -> Iterator:
    """A real tmpfs of `size` (e.g. "8m") mounted at `mnt`: writes hit a real ENOSPC."""
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def corrupt_block(store_dir: str, key: bytes) -> bool:
    """Flip one data byte of the block stored under `key` (found by its slot header)."""
    for name in os.listdir(store_dir):
        parsed = slot_format.parse_segment_name(name)
        if parsed is None:
            continue
        _, slot_bytes = parsed
        path = os.path.join(store_dir, name)
        with open(path, "r+b") as f:
            size = os.path.getsize(path)
            for off in range(0, size, slot_bytes):
                f.seek(off)
                h = slot_format.unpack_header(f.read(slot_format.HEADER_BYTES))
                if h is not None and h.key == key:
                    f.seek(off + slot_format.HEADER_BYTES + 100)
                    b = f.read(1)
                    f.seek(off + slot_format.HEADER_BYTES + 100)
                    f.write(bytes([b[0] ^ 0xFF]))
                    return True
    return False


def cached_bytes(d: object) -> int:
    """Bytes of the store's slab files in the page cache (cachestat)."""
    total = 0
    for f in glob.glob(os.path.join(str(d), "seg-*.slab")):
        fd = os.open(f, os.O_RDONLY)
        try:
            got = pagecache.cached_bytes(fd)
        finally:
            os.close(fd)
        assert got is not None
        total += got
    return total
