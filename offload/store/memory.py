"""In-memory block store: the DRAM tier and the fake the tests use (with failure switches).

Primitives: `MemoryStore(capacity, reserve=0)` implementing `BlockStore`.
Lifecycle: construct with a capacity; blocks are evicted least-recently-used past it; `close()`
stops the reserve thread. Not shared between processes.

Memory: each block lives in one slot, written with one copy (large copies release the GIL, so the
agent's NIXL thread keeps moving bytes meanwhile). Slots of evicted or deleted blocks are kept by
size and reused (the blocks of one deployment all have the same size), so that a full store copies
into memory already in use instead of faulting in new pages (about 5x slower on small VMs).
With `reserve > 0` (the agent's DRAM tier) slots are carved from one arena of `capacity` bytes of
address space, and a background thread keeps `reserve` bytes past the fill point faulted in
(MADV_POPULATE_WRITE), so that a burst of puts into an empty tier costs no page faults either.
Memory held (blocks, kept slots, the faulted-in reserve) stays within `capacity`: kept slots of
other sizes are given back when a new size needs room.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
from collections import OrderedDict
from typing import Sequence

from offload.keys import Namespace
from offload.store.base import Buffer, StoreStats, total_len

log = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
_NUMPY_FROM = 64 << 10       # copies at least this large go through numpy, which frees the GIL
_MAP_NORESERVE = 0x4000      # Linux; address space only, pages are committed as they are touched
_MADV_POPULATE_WRITE = 23    # Linux >= 5.14
_POPULATE_STEP = 4 << 20


def _pages(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


def _copy(dst: memoryview, src: memoryview) -> None:
    """dst[:] = src. A memoryview copy holds the GIL for its whole length; numpy's does not, so
    a large copy here runs alongside the agent's NIXL thread instead of stalling it."""
    if dst.nbytes < _NUMPY_FROM:
        dst[:] = src
        return
    import numpy as np

    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


class MemoryStore:
    def __init__(self, capacity: int = 1 << 30, reserve: int = 0):
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, memoryview] = OrderedDict()
        self._used = 0                      # bytes of stored blocks (what the cap counts)
        self._free: dict[int, list[memoryview]] = {}   # reusable slots by block size
        self._free_bytes = 0                # memory held by those slots
        self._lock = threading.Lock()
        self._stats = StoreStats(capacity=capacity)
        self._recycled = 0
        # The arena (reserve > 0): slots carved page-aligned from _top; [_top, _ready) faulted in.
        self._arena: mmap.mmap | None = None
        self._arena_view: memoryview | None = None
        self._top = 0
        self._ready = 0
        self._reserve = _pages(min(reserve, capacity))
        self._arena_at: dict[int, int] = {}    # id of an arena slot -> its offset
        self._wake = threading.Condition(self._lock)
        self._closed = False
        if self._reserve > 0 and sys.platform.startswith("linux"):
            self._arena = mmap.mmap(-1, _pages(capacity),
                                    flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
            self._arena_view = memoryview(self._arena)
            threading.Thread(target=self._populate, name="memory-store-reserve",
                             daemon=True).start()
        # Failure switches for tests: keys whose reads/writes fail.
        self.fail_reads: set[bytes] = set()
        self.fail_writes: set[bytes] = set()
        self.namespaces: dict[bytes, dict[str, object]] = {}

    def _populate(self) -> None:
        """Keep `reserve` bytes past the fill point faulted in (outside the lock, GIL released)."""
        assert self._arena is not None
        try:   # refill when the tier is idle, not while it competes with the copies it speeds up
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._arena))
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        size = len(self._arena)
        while True:
            with self._wake:
                while not self._closed and self._ready >= min(size, self._top + self._reserve):
                    self._wake.wait()
                if self._closed:
                    return
                start = max(self._ready, self._top)
                n = min(_POPULATE_STEP, min(size, self._top + self._reserve) - start)
            if madvise(base + start, n, _MADV_POPULATE_WRITE) != 0:
                log.info("DRAM tier: pages cannot be faulted in ahead (errno %d); filling it "
                         "faults them in as it goes", ctypes.get_errno())
                return
            with self._wake:
                self._ready = max(self._ready, start + n)

    # ---------------------------------------------------------------- slots (lock held)
    def _held_bytes(self) -> int:
        """Memory held besides stored blocks: kept slots and the arena's uncarved part."""
        return self._free_bytes + max(0, self._ready - self._top)

    def _release(self, slot: memoryview) -> None:
        """Keep a slot whose block left the store, for the next block of its size."""
        self._free.setdefault(slot.nbytes, []).append(slot)
        self._free_bytes += slot.nbytes

    def _drop_free(self, need: int) -> None:
        """Give kept slots back (to the OS) until `need` more bytes fit in the capacity."""
        for size in sorted(self._free, reverse=True):
            slots = self._free[size]
            while slots and self._used + self._held_bytes() + need > self.capacity:
                slot = slots.pop()
                self._free_bytes -= slot.nbytes
                self._forget(slot)
            if not slots:
                del self._free[size]
            if self._used + self._held_bytes() + need <= self.capacity:
                return

    def _forget(self, slot: memoryview) -> None:
        start = self._arena_at.pop(id(slot), None)
        if start is not None and self._arena is not None:
            # An arena slot stays mapped (its address range is a hole now); its pages go back.
            end = (start + slot.nbytes) // _PAGE * _PAGE
            try:
                if end > start:
                    self._arena.madvise(mmap.MADV_DONTNEED, start, end - start)
            except (OSError, ValueError):
                pass
        slot.release()

    def _slot(self, size: int) -> memoryview | None:
        """A slot for a block of `size` bytes, once `_used + size <= capacity`."""
        slots = self._free.get(size)
        if slots:
            slot = slots.pop()
            if not slots:
                del self._free[size]
            self._free_bytes -= size
            self._recycled += 1
            return slot
        av = self._arena_view
        if av is not None and self._top + size <= av.nbytes:
            slot = av[self._top:self._top + size]
            self._arena_at[id(slot)] = self._top
            self._top = min(av.nbytes, self._top + _pages(size))
            self._wake.notify()
            return slot
        if self._used + self._held_bytes() + size > self.capacity:
            self._drop_free(size)
        if self._used + self._held_bytes() + size > self.capacity:
            return None
        return memoryview(bytearray(size))

    # ---------------------------------------------------------------- BlockStore
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]) -> list[bool]:
        out = []
        with self._lock:
            for key, bufs in zip(keys, blocks):
                if key in self.fail_writes:
                    self._stats.put_skipped += 1
                    out.append(False)
                    continue
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    out.append(True)
                    continue
                try:
                    views = [memoryview(b).cast("B") for b in bufs]
                except (TypeError, ValueError):
                    self._stats.put_skipped += 1
                    out.append(False)
                    continue
                size = sum(v.nbytes for v in views)
                if size > self.capacity:
                    self._stats.put_skipped += 1
                    out.append(False)
                    continue
                while self._used + size > self.capacity:
                    _, old = self._blocks.popitem(last=False)
                    self._used -= old.nbytes
                    self._release(old)
                    self._stats.evictions += 1
                slot = self._slot(size)
                if slot is None:
                    self._stats.put_skipped += 1
                    out.append(False)
                    continue
                pos = 0
                for v in views:
                    _copy(slot[pos:pos + v.nbytes], v)
                    pos += v.nbytes
                self._blocks[key] = slot
                self._used += size
                self._stats.puts += 1
                self._stats.bytes_written += size
                out.append(True)
        return out

    def get_many(self, keys: Sequence[bytes], dests: Sequence[Sequence[Buffer]]) -> list[bool]:
        out = []
        with self._lock:
            for key, bufs in zip(keys, dests):
                slot = self._blocks.get(key)
                if slot is None or key in self.fail_reads or total_len(bufs) != slot.nbytes:
                    self._stats.misses += 1
                    out.append(False)
                    continue
                self._blocks.move_to_end(key)
                pos = 0
                for b in bufs:
                    mv = memoryview(b).cast("B")
                    _copy(mv, slot[pos:pos + mv.nbytes])
                    pos += mv.nbytes
                self._stats.hits += 1
                self._stats.bytes_read += slot.nbytes
                out.append(True)
        return out

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._blocks for k in keys]

    def delete_many(self, keys: Sequence[bytes]) -> int:
        n = 0
        with self._lock:
            for k in keys:
                slot = self._blocks.pop(k, None)
                if slot is not None:
                    self._used -= slot.nbytes
                    self._release(slot)
                    n += 1
        return n

    def clear(self, namespace: bytes | None = None) -> int:
        with self._lock:
            keys = [k for k in self._blocks if namespace is None or k.startswith(namespace)]
        return self.delete_many(keys)

    def register_namespace(self, ns: Namespace) -> None:
        self.namespaces[ns.digest()] = ns.describe()

    def stats(self) -> StoreStats:
        with self._lock:
            s = StoreStats(**vars(self._stats))
            s.blocks, s.bytes_used = len(self._blocks), self._used
            s.extra = {**self._stats.extra, "recycled_slots": self._recycled,
                       "spare_bytes": self._held_bytes()}
            return s

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
