"""Red team of the page-cache share (`store.page_cache`) against a power cut: with a budget, blocks
are written through a buffered fd and the oldest are written back and dropped past the budget;
the committer's fdatasync (on the slab's O_DIRECT fd) must still cover every block a flush
acknowledged. On `lazyfs.py` (what was not fsync'ed is lost with its process): a writer process
with a 1 MiB budget (drops happen) puts and flushes 64 blocks, puts 32 more without a flush, then
the file system and the writer are killed; after a remount every flushed block reads back
exactly and an unflushed one is its own bytes or a miss, never another's (held).
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.powerloss.harness import LazyMount, lazyfs_unavailable
from tests.store.blocks import data, key
from tests.store.stores import open_store

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(bool(lazyfs_unavailable()), reason=lazyfs_unavailable() or "-")]

ROOT = str(Path(__file__).resolve().parents[2])
SIZE = 64 << 10

WRITER = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from tests.store.blocks import data, key
from tests.store.stores import open_store
d, size = sys.argv[2], int(sys.argv[3])
s = open_store(d, 1 << 30, o_direct="on", page_cache=1 << 20, segment_size=1 << 20)
ks = [key(i) for i in range(64)]
ok = s.put_many(ks, [[data(k, size)] for k in ks])
flushed = s.flush(30)
print(json.dumps({"acked": [i for i, f in enumerate(ok) if f and flushed],
                  "held": s.stats().extra["page_cache_held"]}), flush=True)
more = [key(i) for i in range(64, 96)]
s.put_many(more, [[data(k, size)] for k in more])
print("ready", flush=True)
time.sleep(600)
"""


def test_flushed_blocks_written_through_the_page_cache_survive_a_power_cut(tmp_path: Path):
    m = LazyMount(tmp_path / "backing", tmp_path / "mnt", tmp_path / "lazyfs.log")
    m.mount()
    w = subprocess.Popen([sys.executable, "-c", WRITER, ROOT, str(m.mountpoint), str(SIZE)],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert w.stdout is not None
        first = json.loads(w.stdout.readline())
        assert w.stdout.readline().strip() == "ready"
        assert len(first["acked"]) == 64
        assert 0 < first["held"] <= 1 << 20   # the budget was in use: drops happened
    finally:
        m.cut()   # the power cut: what lazyfs held unsynced is gone
        w.kill()
        w.wait(30)
    m.mount()
    try:
        s = open_store(m.mountpoint, 1 << 30, o_direct="on", page_cache=0,
                       segment_size=1 << 20)
        try:
            bufs = [mmap.mmap(-1, SIZE) for _ in range(96)]
            ok = s.get_many([key(i) for i in range(96)], [[b] for b in bufs])
            right = [bytes(b) == data(key(i), SIZE) for i, b in enumerate(bufs)]
        finally:
            s.close()
    finally:
        m.cut()
    assert all(ok[i] and right[i] for i in first["acked"]), (ok, right)
    assert all(right[i] for i in range(96) if ok[i])   # a later block: its bytes or a miss
    assert os.path.isdir(tmp_path / "backing")
