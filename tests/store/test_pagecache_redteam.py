"""Red team of the disk store's page-cache share (`store.page_cache`, `slab/pagecache.py`): what the
promises say ("never serve a wrong block", the budget "per process and directory", 0 = pure
O_DIRECT) tried against real files with O_DIRECT and cachestat, and a second real process that
shares the directory and rewrites the slots the first one holds cached.

- a slot another process rewrote (O_DIRECT or buffered) while this process held its old bytes in
  the page cache: the old block is a miss, the new one its own bytes (held);
- reads of a slot racing another process rewriting it with two blocks in turn: every read that
  reports success holds the bytes of the block asked for (held);
- two stores of one process on one directory: together they keep twice the budget cached, where
  the budget was documented per process and directory (broke: xfail, strict; the docs now
  say per open store, and one budget per directory is left to do);
- a large put, measured by the store's gate as each write piece lands: the page cache holds the
  writes in flight beyond the budget, documented as never more than the budget (broke: xfail);
- reads racing the drops of their own slots (evicted by puts): only right bytes (held);
- many small puts, each batch's drops racing the last batch's commit (fdatasync): evicted slots
  stayed cached outside the budget, growing with the puts (broke; fixed: a drop that left
  pages is counted and tried again, at the next keep and after the slab's sync).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pytest

from offload.store.disk.location import Location
from offload.store.disk.slab import coalesce
from offload.store.disk.slab import format as slot_format
from offload.store.disk.slab.files import SlabFiles
from offload.store.disk.slab.format import HEADER_BYTES
from offload.store.disk.slab.gate import IoGate
from tests.store.blocks import data, key
from tests.store.stores import cached_bytes, open_store

SIZE = 256 << 10
SLOT = slot_format.slot_bytes_for(SIZE)
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")

# Another process on the same directory: writes block i (its key and bytes) into slot 0 of the
# segment, O_DIRECT (budget 0) or buffered (a budget), once per index read from stdin.
REWRITER = """
import sys
sys.path.insert(0, sys.argv[1])
from offload.store.disk.slab.files import SlabFiles
from offload.store.disk.slab import format as slot_format
from tests.store.blocks import data, key
d, size, budget = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
slot_bytes = slot_format.slot_bytes_for(size)
s = SlabFiles(d, "on", page_cache=budget)
for line in sys.stdin:
    i = int(line)
    b = data(key(i), size)
    w = s.write_block(0, slot_bytes, 0, key(i), [b], size, slot_format.checksum([b]), 1)
    print("ok" if w.ok else w.reason, flush=True)
s.close()
"""


def loc(i: int) -> Location:
    b = data(key(i), SIZE)
    return Location(key(i), 0, 0, SLOT, SIZE, slot_format.checksum([b]))


class Rewriter:
    """The other process: `write(i)` puts block i into slot 0 and waits for its word."""

    def __init__(self, d, budget: int):
        self.p = subprocess.Popen([sys.executable, "-c", REWRITER, ROOT, str(d), str(SIZE),
                                   str(budget)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)

    def write(self, i: int) -> None:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(f"{i}\n")
        self.p.stdin.flush()
        assert self.p.stdout.readline().strip() == "ok"

    def close(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.close()
        assert self.p.wait(30) == 0


def read(slabs: SlabFiles, pool, i: int) -> tuple[slot_format.ReadOutcome, bytes]:
    buf = mmap.mmap(-1, SIZE)
    [got] = coalesce.read_batch(slabs, pool, [loc(i)], [[buf]], 1)
    return got, bytes(buf)


@pytest.mark.parametrize("other_budget", [0, 64 << 20], ids=["o_direct", "buffered"])
def test_a_slot_rewritten_by_another_process_is_never_served_stale(store_dir, other_budget):
    """This process writes block 1 buffered and reads it from the page cache; the other process
    puts block 2 into the same slot; block 1 is then a miss and block 2 reads as its own bytes."""
    slabs = SlabFiles(str(store_dir), "on", page_cache=64 << 20)
    pool = ThreadPoolExecutor(2)
    other = Rewriter(store_dir, other_budget)
    try:
        slabs.create(0, SLOT, 4)
        b1 = data(key(1), SIZE)
        assert slabs.write_block(0, SLOT, 0, key(1), [b1], SIZE, loc(1).csum, 1).ok
        got, raw = read(slabs, pool, 1)
        assert got.ok and got.cached and raw == b1
        other.write(2)
        got, raw = read(slabs, pool, 1)
        assert not got.ok   # block 1 is gone from the slot: a miss, not its old cached bytes
        got, raw = read(slabs, pool, 2)
        assert got.ok and raw == data(key(2), SIZE)
    finally:
        other.close()
        pool.shutdown()
        slabs.close()


@pytest.mark.parametrize("other_budget", [0, 64 << 20], ids=["o_direct", "buffered"])
def test_reads_racing_another_process_rewriting_the_slot_serve_only_the_block_asked(
        store_dir, other_budget):
    """A reader thread reads block 1 over and over (from the page cache where cachestat finds it
    whole) while the other process writes blocks 1 and 2 into the slot in turn: a read that
    succeeds holds block 1's bytes, every time."""
    slabs = SlabFiles(str(store_dir), "on", page_cache=64 << 20)
    pool = ThreadPoolExecutor(2)
    other = Rewriter(store_dir, other_budget)
    rounds = 60
    try:
        slabs.create(0, SLOT, 4)
        b1 = data(key(1), SIZE)
        assert slabs.write_block(0, SLOT, 0, key(1), [b1], SIZE, loc(1).csum, 1).ok
        seen = {"ok": 0, "cached": 0, "wrong": 0, "miss": 0}

        def reader(n: int) -> None:
            for _ in range(n):
                got, raw = read(slabs, pool, 1)
                if got.ok:
                    seen["ok"] += 1
                    seen["cached"] += got.cached
                    seen["wrong"] += raw != b1
                else:
                    seen["miss"] += 1

        with ThreadPoolExecutor(1) as t:
            fut = t.submit(reader, rounds * 8)
            for r in range(rounds):
                other.write(2 if r % 2 == 0 else 1)
            fut.result()
        assert seen["wrong"] == 0, seen
        assert seen["ok"] + seen["miss"] == rounds * 8
    finally:
        other.close()
        pool.shutdown()
        slabs.close()


def test_one_store_keeps_its_budget(store_dir):
    """The budget bounds what one store leaves cached (held: the reference for the next test)."""
    budget = 1 << 20
    s = open_store(store_dir, 1 << 30, o_direct="on", page_cache=budget)
    try:
        ks = [key(i) for i in range(16)]
        assert all(s.put_many(ks, [[data(k, SIZE)] for k in ks]))
        assert s.flush(30)
        assert cached_bytes(store_dir) <= budget
    finally:
        s.close()


@pytest.mark.xfail(strict=True, reason="the budget is held per SlabFiles (one PageCache per "
                   "store), not per process and directory as docs/reference/config.md and "
                   "docs/design/store.md say: two stores of one process on one directory keep "
                   "twice the budget cached")
def test_two_stores_of_one_process_on_one_directory_share_one_budget(store_dir):
    budget = 1 << 20   # three blocks of 256 KiB + their headers
    a = open_store(store_dir, 1 << 30, o_direct="on", page_cache=budget)
    b = open_store(store_dir, 1 << 30, o_direct="on", page_cache=budget)
    try:
        for s, first in ((a, 0), (b, 100)):
            ks = [key(i) for i in range(first, first + 16)]
            assert all(s.put_many(ks, [[data(k, SIZE)] for k in ks]))
            assert s.flush(30)
        held = cached_bytes(store_dir)
        assert held >= budget // (HEADER_BYTES + SIZE) * (HEADER_BYTES + SIZE)
        assert held <= budget, f"{held} bytes cached for a budget of {budget}"
    finally:
        a.close()
        b.close()


class MeasuringGate(IoGate):
    """The store's own gate, which also reads (cachestat) what the store's slab files hold in the
    page cache as each write piece completes: the most it saw, in bytes."""

    def __init__(self, d) -> None:
        super().__init__()
        self.d, self.most = d, 0

    @contextlib.contextmanager
    def writing(self, nbytes: int) -> Iterator[None]:
        with super().writing(nbytes):
            yield
        self.most = max(self.most, cached_bytes(self.d))


@pytest.mark.xfail(strict=True, reason="a block (or a run's pieces) is kept, and the oldest "
                   "dropped, only once written: a put of 64 blocks of 256 KiB held 2.7-2.9 MB in "
                   "the page cache for a 1 MiB budget, 2.7 MB of it dirty (3 slots kept, 7-8 in "
                   "flight: one per I/O thread); docs/design/store.md names the overshoot (the LRU "
                   "updated when a run's write returns) until the drop follows each piece")
def test_a_large_put_never_holds_more_than_the_budget(store_dir):
    budget = 1 << 20
    gate = MeasuringGate(store_dir)
    s = open_store(store_dir, 1 << 30, o_direct="on", page_cache=budget, gate=gate)
    try:
        ks = [key(i) for i in range(64)]
        assert all(s.put_many(ks, [[data(k, SIZE)] for k in ks]))
        assert s.flush(30)
        assert cached_bytes(store_dir) <= budget   # after the put: held
        assert gate.most <= budget, f"{gate.most} bytes in the page cache for a budget of {budget}"
    finally:
        s.close()


def test_many_puts_leave_no_more_than_the_budget_cached(store_dir):
    """Puts in many small batches (each batch's drops racing the commit round of the batch
    before, its fdatasync): once flushed, what the store's files hold in the page cache is within
    the budget."""
    budget = 1 << 20
    s = open_store(store_dir, 1 << 30, o_direct="on", page_cache=budget)
    try:
        for r in range(120):
            ks = [key(1000 + r * 8 + j) for j in range(8)]
            assert all(s.put_many(ks, [[data(k, SIZE)] for k in ks]))
        assert s.flush(30)
        assert s.stats().extra["page_cache_held"] <= budget
        held = cached_bytes(store_dir)
        assert held <= budget, f"{held} bytes cached for a budget of {budget}"
    finally:
        s.close()


def test_reads_racing_the_drops_of_their_slots_serve_only_right_bytes(store_dir):
    """A reader thread reads 24 blocks over and over (those cachestat finds whole from the page
    cache) while 20 puts of 8 blocks evict their slots from the budget (write back, DONTNEED):
    every block read is its own bytes (held)."""
    budget = 1 << 20
    s = open_store(store_dir, 1 << 30, o_direct="on", page_cache=budget)
    try:
        ks = [key(i) for i in range(24)]
        assert all(s.put_many(ks, [[data(k, SIZE)] for k in ks]))
        assert s.flush(30)
        seen = {"ok": 0, "wrong": 0}
        stop = threading.Event()

        def reader() -> None:
            while not stop.is_set():
                bufs = [mmap.mmap(-1, SIZE) for _ in ks]
                ok = s.get_many(ks, [[b] for b in bufs])
                seen["ok"] += sum(ok)
                seen["wrong"] += sum(1 for k, f, b in zip(ks, ok, bufs)
                                     if f and bytes(b) != data(k, SIZE))

        with ThreadPoolExecutor(1) as t:
            fut = t.submit(reader)
            try:
                for r in range(20):
                    more = [key(1000 + r * 8 + j) for j in range(8)]
                    assert all(s.put_many(more, [[data(k, SIZE)] for k in more]))
            finally:
                stop.set()
            fut.result()
        assert seen["ok"] > 0 and seen["wrong"] == 0, seen
    finally:
        s.close()
