"""The disk store's page-cache share (`store.page_cache`, `offload/store/disk/slab/pagecache.py`):
a block written, then read by a new process after the store was closed, is served from the page
cache (counted, verified); a cached page damaged behind the store's back is never served; the
budget bounds what the store's files hold in the page cache (measured with cachestat); budget 0
is pure O_DIRECT. Real files with O_DIRECT, real processes.
"""

from __future__ import annotations

import glob
import json
import mmap
import os
import subprocess
import sys

from offload.store.disk.slab import pagecache
from offload.store.disk.slab.format import HEADER_BYTES
from tests.store.blocks import data, key
from tests.store.stores import cached_bytes, open_store

SIZE = 256 << 10
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")

READER = """
import json, mmap, sys
sys.path.insert(0, sys.argv[1])
from tests.store.blocks import data, key
from tests.store.stores import open_store
d, n, size, budget = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
s = open_store(d, 1 << 30, o_direct="on", page_cache=budget)
bufs = [mmap.mmap(-1, size) for _ in range(n)]
ok = s.get_many([key(i) for i in range(n)], [[b] for b in bufs])
st = s.stats()
print(json.dumps({"ok": ok, "right": [bytes(b) == data(key(i), size) for i, b in enumerate(bufs)],
                  "reads_cached": st.extra["reads_cached"], "bad": st.checksum_failures}))
s.close()
"""


def put(d, n: int, budget: int) -> None:
    s = open_store(d, 1 << 30, o_direct="on", page_cache=budget)
    try:
        assert all(s.put_many([key(i) for i in range(n)],
                              [[data(key(i), SIZE)] for i in range(n)]))
        assert s.flush(30)
    finally:
        s.close()


def read_in_new_process(d, n: int, budget: int) -> dict:
    r = subprocess.run([sys.executable, "-c", READER, ROOT, str(d), str(n), str(SIZE), str(budget)],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_restart_is_served_from_the_page_cache_and_verified(store_dir):
    put(store_dir, 8, 64 << 20)
    got = read_in_new_process(store_dir, 8, 64 << 20)
    assert got["ok"] == [True] * 8 and got["right"] == [True] * 8
    assert got["reads_cached"] == 8


def test_budget_zero_is_pure_o_direct(store_dir):
    put(store_dir, 8, 0)
    assert cached_bytes(store_dir) == 0   # O_DIRECT writes leave nothing in the page cache
    got = read_in_new_process(store_dir, 8, 0)
    assert got["ok"] == [True] * 8 and got["right"] == [True] * 8
    assert got["reads_cached"] == 0
    assert cached_bytes(store_dir) == 0


def test_the_budget_bounds_the_page_cache(store_dir):
    budget = 1 << 20   # three blocks of 256 KiB + their headers
    s = open_store(store_dir, 1 << 30, o_direct="on", page_cache=budget)
    try:
        for start in range(0, 32, 8):
            ks = [key(i) for i in range(start, start + 8)]
            assert all(s.put_many(ks, [[data(k, SIZE)] for k in ks]))
            # once its commit is done: a put's last slots are kept (and the oldest dropped) by
            # the I/O threads as their writes return, which may be just after put_many does
            # (the overshoot of the writes in flight: test_pagecache_redteam's large put)
            assert s.flush(30)
            assert cached_bytes(store_dir) <= budget
        assert s.flush(30)
        assert cached_bytes(store_dir) <= budget
        bufs = [mmap.mmap(-1, SIZE) for _ in range(32)]
        assert all(s.get_many([key(i) for i in range(32)], [[b] for b in bufs]))
        assert all(bytes(b) == data(key(i), SIZE) for i, b in enumerate(bufs))
        assert cached_bytes(store_dir) <= budget
        st = s.stats()
        # the newest blocks that fit the budget were served from it, the rest from the device
        assert st.extra["reads_cached"] == budget // (HEADER_BYTES + SIZE)
        assert st.extra["page_cache_held"] <= budget
    finally:
        s.close()


def test_a_damaged_cached_page_is_never_served(store_dir):
    put(store_dir, 4, 64 << 20)
    s = open_store(store_dir, 1 << 30, o_direct="on", page_cache=64 << 20)
    try:
        [path] = glob.glob(os.path.join(str(store_dir), "seg-*.slab"))
        with open(path, "rb") as f:   # where block 2's data lies (found by its bytes)
            at = f.read().index(data(key(2), SIZE)[:4096])
        fd = os.open(path, os.O_RDWR)   # buffered, behind the store's back: the page cache
        try:
            os.pwrite(fd, os.urandom(4096), at + 8192)
            assert pagecache.warm(fd, at - HEADER_BYTES, HEADER_BYTES + SIZE)
        finally:
            os.close(fd)
        bufs = [mmap.mmap(-1, SIZE) for _ in range(4)]
        ok = s.get_many([key(i) for i in range(4)], [[b] for b in bufs])
        assert ok == [True, True, False, True]
        assert [bytes(b) == data(key(i), SIZE) for i, b in enumerate(bufs)] == [True, True,
                                                                                False, True]
        st = s.stats()
        assert st.extra["reads_cached"] == 3
        assert st.checksum_failures == 1   # read again from the device: bad there too, dropped
        assert s.exists_many([key(2)]) == [False]
    finally:
        s.close()
