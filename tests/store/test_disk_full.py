"""A full disk never loses a block `flush()` called durable (issue 36, item 9).

1. ENOSPC at every call of the put path that can need disk space, one by one: `enospc.c`, loaded
   with LD_PRELOAD into a worker (`enospc_worker.py`), fails the n-th such call on the cache
   directory -- a slab write, a sync, a hole punch, a slab's creation, SQLite's log or database
   write -- for every n the path makes, and then (a full disk for a while) 16 calls in a row from
   every n. After each, a new store reads back every block `flush()` called durable: all there,
   byte-exact, unless the change log records that the store deleted or evicted it.
2. A real full file system: ext4 on a loop device, filled to 100 % by another process and freed
   again, four times, while a writer puts and flushes (skipped where loop devices cannot be
   mounted).
Real processes, real files; no mock."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.store.blocks import data, key
from tests.store.stores import open_store

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
ROOT = str(HERE.parents[1])
ENV = dict(os.environ, PYTHONPATH=ROOT)


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler to build the ENOSPC shim (LD_PRELOAD)")
    out = str(tmp_path_factory.mktemp("shim") / "enospc.so")
    r = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", out, str(HERE / "enospc.c"), "-ldl"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot build the ENOSPC shim: {r.stderr.strip()[:300]}")
    return out


def sweep(shim: str, root: Path, first: int, last: int, count: int) -> list[dict]:
    root.mkdir(exist_ok=True)
    r = subprocess.run([sys.executable, str(HERE / "enospc_worker.py"), shim, str(root),
                        str(first), str(last), str(count)], capture_output=True, text=True,
                       env=dict(ENV, LD_PRELOAD=shim), timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines()]


def test_enospc_at_every_write_of_the_put_path_loses_no_durable_block(shim, tmp_path):
    (clean,) = sweep(shim, tmp_path / "clean", 1 << 40, 1 << 40, 1)   # nothing fails: the count
    calls = clean["calls"]
    assert clean["acked"] >= 24 and not clean["lost"] and not clean["wrong"], clean
    assert calls > 50, clean   # the path was exercised (writes, syncs, punches, SQLite)
    bad = [r for r in sweep(shim, tmp_path / "one", 1, calls, 1) if r["lost"] or r["wrong"]]
    assert bad == [], bad[:5]
    bad = [r for r in sweep(shim, tmp_path / "run", 1, calls, 16) if r["lost"] or r["wrong"]]
    assert bad == [], bad[:5]


def _loop_fs(tmp_path: Path, mib: int) -> Path:
    img, mnt = tmp_path / "fs.img", tmp_path / "fs"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(mib << 20)
    r = subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot make an ext4 file system here: {r.stderr.strip()}")
    r = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a loop device here: {r.stderr.strip()}")
    return mnt


def _fill(path: Path) -> None:
    """Take every free byte of the file system (as another tenant's job would)."""
    with open(path, "wb") as f:
        for chunk in (1 << 20, 4096):
            try:
                while True:
                    f.write(b"\0" * chunk)
                    f.flush()
            except OSError:
                pass


def test_a_real_full_file_system_loses_no_durable_block(tmp_path):
    mnt = _loop_fs(tmp_path, 64)
    try:
        d = mnt / "cache"
        with open_store(d):
            pass
        stop = tmp_path / "stop"
        w = subprocess.Popen([sys.executable, str(HERE / "procs.py"), "stream", str(d),
                              json.dumps({"batch": 8, "stop": str(stop), "size": 65536})],
                             stdout=subprocess.PIPE, text=True, env=ENV)
        acked: list[int] = []

        def read() -> None:
            for text in w.stdout:   # type: ignore[union-attr]
                rec = json.loads(text)
                if rec["flushed"]:
                    acked.extend(rec["from"] + j for j, ok in enumerate(rec["ok"]) if ok)

        t = threading.Thread(target=read)
        t.start()
        try:
            for rnd in range(4):
                time.sleep(1.0)
                _fill(mnt / f"fill{rnd}")
                time.sleep(2.0)
                os.unlink(mnt / f"fill{rnd}")
            time.sleep(1.0)
        finally:
            stop.touch()
            assert w.wait(300) == 0
            t.join(60)
        assert acked
        db = sqlite3.connect(f"file:{d}/index.db?mode=ro", uri=True)
        try:   # evicted to keep the file system's room: recorded, not lost
            gone = {bytes(k) for (k,) in db.execute("SELECT key FROM changes WHERE op=2")}
        finally:
            db.close()
        lost, wrong = [], []
        with open_store(d) as s:
            for i in acked:
                buf = bytearray(65536)
                if not s.get_many([key(i)], [[buf]])[0]:
                    if key(i) not in gone:
                        lost.append(i)
                elif bytes(buf) != data(key(i), 65536):
                    wrong.append(i)
        assert lost == [] and wrong == [], (len(acked), lost[:20], wrong[:20])
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
