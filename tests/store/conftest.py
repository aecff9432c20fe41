"""Fixtures of the store tests: one way to open a disk store (`tests/store/stores.py`).

- `disk_store`: an empty `DiskStore` on `tmp_path/cache` (64 MiB), closed at teardown.
- `open_disk`: `open_disk(path=None, **kw)` opens a `DiskStore` as `stores.open_store` does
  (on `tmp_path/cache` by default); every store it opened is closed at teardown.
- `store_dir`: an empty directory that takes O_DIRECT on a kernel with `cachestat(2)` (the
  page-cache share's tests; they skip elsewhere).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator

import pytest

from offload.store.disk.slab import pagecache
from offload.store.disk.store import DiskStore
from tests.store.stores import open_store


@pytest.fixture
def open_disk(tmp_path: Path) -> Iterator[Callable[..., DiskStore]]:
    opened: list[DiskStore] = []

    def _open(path: Path | str | None = None, **kw: object) -> DiskStore:
        s = open_store(tmp_path / "cache" if path is None else path, **kw)
        opened.append(s)
        return s

    yield _open
    for s in reversed(opened):
        s.close()


@pytest.fixture
def disk_store(open_disk: Callable[..., DiskStore]) -> DiskStore:
    return open_disk(capacity=64 << 20)


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    """A directory that takes O_DIRECT, on a kernel with cachestat (else the test skips)."""
    d = tmp_path / "c"
    d.mkdir()
    probe = d / "probe"
    probe.write_bytes(b"x")
    fd = os.open(probe, os.O_RDONLY)
    try:
        if pagecache.cached(fd, 0, 1) is None:
            pytest.skip("no cachestat(2) on this kernel (Linux 6.5+): every read is O_DIRECT")
        try:
            os.close(os.open(d / "direct", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        except OSError as e:
            pytest.skip(f"{d} refuses O_DIRECT ({e.strerror})")
    finally:
        os.close(fd)
    os.unlink(probe)
    os.unlink(d / "direct")
    return d
