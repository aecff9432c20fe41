"""The bounded share of the kernel's page cache a disk store's slabs may hold (`store.page_cache`).

With O_DIRECT nothing of ours stays in the page cache, so a restarted server reads every block from
the device. With a budget, the slots most recently written (and read) stay cached up to that many
bytes: blocks are written through a buffered fd (durability unchanged: the committer's fdatasync
of the slab, on any fd of the file, covers them), and beyond the budget the oldest slots are
written back (`sync_file_range`, so no dirty page outlives its slot's place in the budget) and
dropped (`posix_fadvise(DONTNEED)`). A read asks the kernel, without any I/O, how much of a slot's
range is cached (`cachestat(2)`, Linux 6.5+; unavailable: every read is O_DIRECT) and reads it
buffered only when all of its pages are (`WARM_SHARE`: a block missing a few pages, which a host
reclaiming cold pages leaves, read buffered fetched them page by page and ran slower than O_DIRECT
on the test VM, 0.36 against 0.51 GB/s); the caller verifies the bytes exactly as an O_DIRECT read's.

Primitives: `cached(fd, off, n)` (the share of its pages cached; None = cachestat unavailable),
`warm(fd, off, n)` (at least `WARM_SHARE` cached), `cached_bytes(fd)`,
`PageCache(budget, evict)` with `keep(seg, slot_bytes, slot, nbytes)` (a slot now cached: the
oldest beyond the budget handed to `evict`; a drop that left pages behind, held by a concurrent
fdatasync, is counted once and tried again), `retry()` (after a slab's sync), `held()`;
`drop(fd, off, n)` (the `evict` the slabs use: False when pages stayed). The budget is per open
store (two stores of one process on one directory hold one each); clean pages another process
left behind (a restart) are the kernel's to reclaim, and are served while they last.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import threading
from collections import OrderedDict
from typing import Callable

# the kernel's page (4 KiB on x86; 64 KiB on many arm64 kernels, e.g. Grace hosts, where slots
# aligned to 4 KiB share pages with their neighbours)
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
WARM_SHARE = 1.0   # a block is read from the page cache only if every page of it is there
# cachestat(2): one number on every architecture (new system calls share the table from 424 on)
SYS_CACHESTAT = 451
_SYNC_WAIT_BEFORE, _SYNC_WRITE, _SYNC_WAIT_AFTER = 1, 2, 4


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64),
                ("nr_writeback", ctypes.c_uint64), ("nr_evicted", ctypes.c_uint64),
                ("nr_recently_evicted", ctypes.c_uint64)]


_libc: ctypes.CDLL | None = None
_usable: bool | None = None   # cachestat answered once (True) or was refused (False)


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.syscall.restype = ctypes.c_long
        lib.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_uint]
        _libc = lib
    return _libc


def _stat(fd: int, off: int, n: int) -> _Stat | None:
    """cachestat of [off, off+n) (n=0: to the end of the file); None where the kernel has none."""
    global _usable
    if _usable is False or platform.system() != "Linux":
        return None
    rng, st = _Range(off, n), _Stat()
    r = _lib().syscall(ctypes.c_long(SYS_CACHESTAT), ctypes.c_uint(fd), ctypes.byref(rng),
                       ctypes.byref(st), ctypes.c_uint(0))
    if r != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP):
            _usable = False   # an older kernel or a seccomp filter: O_DIRECT for every read
        return None
    _usable = True
    return st


def cached(fd: int, off: int, n: int) -> float | None:
    """The share of the pages of [off, off+n) in the page cache (no I/O); None: no cachestat."""
    first, last = off // PAGE, (off + n + PAGE - 1) // PAGE
    st = _stat(fd, first * PAGE, (last - first) * PAGE)
    return None if st is None else min(1.0, st.nr_cache / max(1, last - first))


def warm(fd: int, off: int, n: int) -> bool:
    """Whether [off, off+n) is worth a buffered read: `WARM_SHARE` of it cached."""
    got = cached(fd, off, n)
    return got is not None and got >= WARM_SHARE


def cached_bytes(fd: int) -> int | None:
    """Bytes of a whole file in the page cache (None: no cachestat)."""
    st = _stat(fd, 0, 0)
    return None if st is None else st.nr_cache * PAGE


def drop(fd: int, off: int, n: int) -> bool:
    """Write [off, off+n) back (data only, no metadata: the commit's fdatasync still makes it
    durable) and drop it from the page cache. False when pages of it stayed (DONTNEED skips pages
    a concurrent fdatasync of the file holds): the caller tries again later."""
    _lib().sync_file_range(fd, off, n, _SYNC_WAIT_BEFORE | _SYNC_WRITE | _SYNC_WAIT_AFTER)
    os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
    # only the pages wholly inside the range can go: DONTNEED keeps a page the range shares
    # with a neighbouring slot (64 KiB pages), which is then the neighbour's to drop
    first, last = -(-off // PAGE), (off + n) // PAGE
    if last <= first:
        return True
    st = _stat(fd, first * PAGE, (last - first) * PAGE)
    return st is None or st.nr_cache == 0


Slot = tuple[int, int, int]   # (seg, slot_bytes, slot)


class PageCache:
    """The slots this process left cached, oldest first, at most `budget` bytes of them, counting
    the slots whose drop left pages behind (`_stuck`: a concurrent fdatasync of the slab held
    them; tried again at each `keep` and after each slab sync, `retry`)."""

    RETRIES_PER_KEEP = 16

    def __init__(self, budget: int, evict: Callable[[int, int, int, int], bool]):
        self.budget = budget
        self._evict = evict          # (seg, slot_bytes, offset, nbytes): write back and drop
        self._slots: OrderedDict[Slot, int] = OrderedDict()
        self._stuck: OrderedDict[Slot, int] = OrderedDict()
        self._bytes = 0              # of `_slots` and `_stuck` together
        self._retries = 0            # `retry` calls so far (a drop that failed while one ran)
        self._lock = threading.Lock()

    def keep(self, seg: int, slot_bytes: int, slot: int, nbytes: int) -> None:
        """A slot now in the page cache (written or read buffered): the newest; the oldest beyond
        the budget are dropped (on the calling thread: a writer's, or a reader's), after the
        slots a drop left behind are tried again."""
        with self._lock:
            k = (seg, slot_bytes, slot)
            self._bytes += nbytes - self._slots.pop(k, 0) - self._stuck.pop(k, 0)
            self._slots[k] = nbytes
            out = self._take_stuck(self.RETRIES_PER_KEEP)
            while self._bytes > self.budget and self._slots:
                old, n = self._slots.popitem(last=False)
                self._bytes -= n
                out.append((old, n))
            seen = self._retries
        self._drop(out, seen)

    def retry(self) -> None:
        """Try again the drops that left pages behind (the slab's fdatasync that held them is
        done: `SlabFiles.sync` calls this after one)."""
        with self._lock:
            self._retries += 1
            out = self._take_stuck(len(self._stuck))
            seen = self._retries
        self._drop(out, seen)

    def _take_stuck(self, most: int) -> list[tuple[Slot, int]]:
        out = []
        for old in list(self._stuck)[:most]:
            n = self._stuck.pop(old)
            self._bytes -= n
            out.append((old, n))
        return out

    def _drop(self, out: list[tuple[Slot, int]], seen: int) -> None:
        """Drop the slots taken out of the books (`seen`: `retry` calls when they were taken);
        one whose pages stayed is counted again, once, unless a `retry` ran meanwhile (the
        fdatasync that held them may be done, and that retry could not see this slot): then
        at once again."""
        for k, n in out:
            since = seen
            while not self._evict(k[0], k[1], k[2] * k[1], n):
                with self._lock:       # pages stayed
                    if k in self._slots or k in self._stuck:
                        break          # kept again, or already waiting for a retry: counted
                    if self._retries == since:
                        self._stuck[k] = n     # counted again, tried at a keep or after a sync
                        self._bytes += n
                        break
                    since = self._retries

    def held(self) -> int:
        """Bytes of slots kept, with those whose drop is still to be retried (what this process
        may have in the page cache)."""
        with self._lock:
            return self._bytes


__all__ = ["PAGE", "WARM_SHARE", "PageCache", "cached", "cached_bytes", "drop", "warm"]
