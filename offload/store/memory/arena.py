"""The DRAM tier's preallocated arena: slots carved from one mapping, faulted in ahead of the puts.

Primitive: `ReservedArena(capacity, reserve, lock)` (Linux), owned by a `MemoryStore` and guarded
by the store's lock. `carve(size)` hands out page-aligned slots from the fill point (`top`);
`forget(slot)` gives a carved slot's pages back; `busy()` notes a store call; `spare()` is the
faulted-in memory past the fill point. A background thread keeps `reserve` bytes past the fill
point faulted in (MADV_POPULATE_WRITE), refilling once the store has had no call for 50 ms (zeroing
pages during a burst would take memory bandwidth from the copies it is meant to speed up).
`wait_ready(timeout)` blocks until the reserve is faulted in; `close()` stops the thread;
`region()` is the mapping's (address, length), registered once with NIXL by the agent.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_MAP_NORESERVE = 0x4000      # Linux; address space only, pages are committed as they are touched
_MADV_POPULATE_WRITE = 23    # Linux >= 5.14
_POPULATE_STEP = 4 << 20
_IDLE_S = 0.05               # the reserve is refilled once the store had no call for this long


def pages(n: int) -> int:
    """n rounded up to whole memory pages."""
    return -(-n // PAGE) * PAGE


class ReservedArena:
    """One mapping of `capacity` bytes of address space (see the module docstring)."""

    def __init__(self, capacity: int, reserve: int, lock: threading.Lock):
        self._map = mmap.mmap(-1, pages(capacity),
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        self._view = memoryview(self._map)
        self._reserve = reserve
        self._top = 0                          # slots are carved page-aligned from here
        self._ready = 0                        # [_top, _ready) is faulted in
        self._at: dict[int, int] = {}          # id of a carved slot -> its offset
        self._wake = threading.Condition(lock)
        self._busy_until = 0.0                 # refills wait until then (calls in progress)
        self._closed = False
        threading.Thread(target=self._populate, name="memory-store-reserve", daemon=True).start()

    # ---------------------------------------------------------------- the store's lock held
    def carve(self, size: int) -> memoryview | None:
        """A new slot of `size` bytes at the fill point, or None when the arena is used up."""
        if self._top + size > self._view.nbytes:
            return None
        slot = self._view[self._top:self._top + size]
        self._at[id(slot)] = self._top
        self._top = min(self._view.nbytes, self._top + pages(size))
        self._wake.notify()
        return slot

    def forget(self, slot: memoryview) -> None:
        """A carved slot stays mapped (its address range is a hole now); its pages go back."""
        start = self._at.pop(id(slot), None)
        if start is None:
            return
        end = (start + slot.nbytes) // PAGE * PAGE
        try:
            if end > start:
                self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass

    def spare(self) -> int:
        """Faulted-in bytes past the fill point (memory held, no block in it yet)."""
        return max(0, self._ready - self._top)

    def busy(self) -> None:
        self._busy_until = time.monotonic() + _IDLE_S

    # ---------------------------------------------------------------- lifecycle
    def region(self) -> tuple[int, int]:
        return ctypes.addressof(ctypes.c_char.from_buffer(self._map)), len(self._map)

    def _target(self) -> int:
        return min(len(self._map), self._top + self._reserve)

    def _populate(self) -> None:
        """Keep `reserve` bytes past the fill point faulted in (outside the lock, GIL released)."""
        try:   # refill when the tier is idle, not while it competes with the copies it speeds up
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        while True:
            with self._wake:
                while not self._closed and self._ready >= self._target():
                    self._wake.wait()
                if self._closed:
                    return
                pause = self._busy_until - time.monotonic()
                if pause > 0:    # zeroing pages would take memory bandwidth from the copies
                    self._wake.wait(pause)
                    continue
                start = max(self._ready, self._top)
                n = min(_POPULATE_STEP, self._target() - start)
            if madvise(base + start, n, _MADV_POPULATE_WRITE) != 0:
                log.info("DRAM tier: pages cannot be faulted in ahead (errno %d); filling it "
                         "faults them in as it goes", ctypes.get_errno())
                return
            with self._wake:
                self._ready = max(self._ready, start + n)

    def wait_ready(self, timeout: float) -> bool:
        """Block until the reserve is faulted in; False if `timeout` passed first."""
        end = time.monotonic() + timeout
        with self._wake:
            while self._ready < self._target():
                left = end - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._wake.wait(min(left, 0.05))
        return True

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
