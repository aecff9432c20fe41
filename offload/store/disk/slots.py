"""DiskStore's `SlotStore` side (medium "file"), for paths that move a block's bytes themselves
(GDS: GPU memory <-> NVMe by DMA).

Primitives:
- `SlotBooks`: what the disk store lends its slot access — its slab files, its stats, and three
  bookkeeping calls that take the store's locks themselves (`allocate`, `finish`, `locate`).
- `SlotAccess`: the `SlotStore` methods, mixed into `DiskStore`; they reach the store only
  through `slot_books()` (built here from the store's index access and committer).
Lifecycle: a path reserves slots (`reserve_slots`: 4 KiB-aligned data areas inside slab files,
counted against the cap like any put), writes the data with its own engine, then `commit_slots`
writes each slot's header with the checksum the path computed (kind WSUM64, verified on the CPU by
`slot_format.wsum64` when such a block is read through the ordinary path), fdatasyncs and makes the
blocks visible — or `abort_slots` frees them. `pin_slots` gives the slots of committed blocks with
their stored checksum, for reads by the same engine; `unpin_slots` counts those reads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from offload.store.base import Slot, SlotMedium, StoreStats, never_raises
from offload.store.disk.commit import BUSY as COMMIT_BUSY
from offload.store.disk.commit import Committer
from offload.store.disk.index.access import BUSY, IndexAccess
from offload.store.disk.index.db import Allocation, Index, Location
from offload.store.disk.slab import files as slab
from offload.store.disk.slab import format as slot_format

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlotBooks:
    slabs: slab.SlabFiles
    stats: StoreStats
    # [(key, length)] of keys not stored yet -> the new slots' locations (cap, eviction)
    allocate: Callable[[list[tuple[bytes, int]]], list[Location]]
    # (committed [(slot, checksum)], failed slots): make visible / free; False if not committed
    finish: Callable[[list[tuple[Location, int]], list[Location]], bool]
    locate: Callable[[list[bytes]], dict[bytes, Location]]


def _slot_of(books: SlotBooks, loc: Location, checksum: int = 0) -> Slot:
    return Slot(loc.key, loc.length, path=books.slabs.path(loc.seg, loc.slot_bytes),
                offset=loc.slot * loc.slot_bytes + slot_format.HEADER_BYTES, checksum=checksum)


def _loc_of(s: Slot) -> Location:
    parsed = slot_format.parse_segment_name(os.path.basename(s.path))
    if parsed is None:
        raise ValueError(f"not a slab file: {s.path}")
    seg, sb = parsed
    return Location(s.key, seg, (s.offset - slot_format.HEADER_BYTES) // sb, sb, s.length, s.checksum)


def _none_each(_self: Any, keys: Sequence[Any], *_: Any) -> list[None]:
    return [None] * len(keys)


def _abort_all(self: "SlotAccess", slots: Sequence[Slot], *_: Any) -> list[bool]:
    self.abort_slots(slots)      # guarded itself: never raises
    return [False] * len(slots)


def _file_wsum64(s: Slot) -> int:
    """The checksum of a slot's bytes as written in its file (a committer that gave none)."""
    fd = os.open(s.path, os.O_RDONLY)
    try:
        return slot_format.wsum64([os.pread(fd, s.length, s.offset)])
    finally:
        os.close(fd)


class SlotAccess:
    slot_medium: SlotMedium = "file"
    # provided by DiskStore
    _slabs: slab.SlabFiles
    _stats: StoreStats
    _lock: threading.RLock
    _keys: set[bytes]
    _ix: IndexAccess
    _commits: Committer
    _orphans: list[Location]

    def _refresh_keys(self) -> bool:
        raise NotImplementedError

    def _allocate(self, items: list[tuple[bytes, int, int, int]]) -> Callable[[Index], Allocation]:
        raise NotImplementedError

    def _commit(self, good: list[tuple[Location, int]], free: list[Location]) -> str:
        raise NotImplementedError

    def slot_books(self) -> SlotBooks:
        """What the store lends: its bookkeeping under its own locks and deadlines."""
        return SlotBooks(self._slabs, self._stats, self._slot_allocate, self._slot_finish,
                         self._slot_locate)

    def _slot_allocate(self, items: list[tuple[bytes, int]]) -> list[Location]:
        with self._lock:
            if not self._refresh_keys():
                return []
            todo = [(k, n, slot_format.slot_bytes_for(n), 0) for k, n in items
                    if k not in self._keys and not self._commits.in_flight(k)]
        alloc = self._ix.write(self._allocate(todo)) if todo else BUSY
        return alloc.new if isinstance(alloc, Allocation) else []

    def _slot_finish(self, good: list[tuple[Location, int]], failed: list[Location]) -> bool:
        """Commit / free slots written (and synced) by another path: False if not committed
        (the slots are then freed, at the latest by the next reservation)."""
        why = self._commit(good, failed)
        if why == COMMIT_BUSY:
            with self._ix.wlock:
                self._orphans += [loc for loc, _ in good] + failed
            return False
        if not why:
            with self._lock:
                self._keys.update(loc.key for loc, _ in good)
        return not why

    def _slot_locate(self, keys: list[bytes]) -> dict[bytes, Location]:
        with self._lock:
            return self._ix.reader.locate(keys)

    def arena_region(self) -> tuple[int, int] | None:
        return None      # file slots: nothing to register in memory

    @never_raises("reserve_slots", _none_each)
    def reserve_slots(self, keys: Sequence[bytes], sizes: Sequence[int]) -> list[Slot | None]:
        """Slots for blocks not stored yet (None: already stored, in flight, or no room)."""
        books = self.slot_books()
        seen: set[bytes] = set()
        items = []
        for k, n in zip(keys, sizes):
            if k not in seen:
                seen.add(k)
                items.append((k, n))
        out: dict[bytes, Slot] = {}
        failed = []
        for loc in books.allocate(items) if items else []:
            err = books.slabs.reserve_space(loc.seg, loc.slot_bytes, loc.slot)
            if err:
                log.warning("slot for %s not reserved: %s", loc.key.hex()[:16], err)
                failed.append(loc)
            else:
                out[loc.key] = _slot_of(books, loc)
        if failed:
            books.finish([], failed)
        return [out.pop(k, None) for k in keys]

    @never_raises("commit_slots", _abort_all)
    def commit_slots(self, slots: Sequence[Slot], checksums: Sequence[int] | None = None
                     ) -> list[bool]:
        """Headers (checksum kind WSUM64) -> fdatasync -> visible. One flag per slot."""
        books = self.slot_books()
        sums = list(checksums) if checksums is not None else [_file_wsum64(s) for s in slots]
        locs = [_loc_of(s) for s in slots]
        now = time.time_ns()
        errs = [books.slabs.write_header(loc.seg, loc.slot_bytes, loc.slot, loc.key,
                                         loc.length, c, now, slot_format.CSUM_WSUM64)
                for loc, c in zip(locs, sums)]
        segs = {(loc.seg, loc.slot_bytes) for loc, e in zip(locs, errs) if not e}
        synced = {sg: books.slabs.sync(*sg) for sg in segs}
        good, bad = [], []
        for loc, c, e in zip(locs, sums, errs):
            if e or not synced[(loc.seg, loc.slot_bytes)]:
                bad.append(loc)
            else:
                good.append((loc, c))
        if not books.finish(good, bad):
            return [False] * len(slots)
        books.stats.puts += len(good)
        books.stats.bytes_written += sum(loc.length for loc, _ in good)
        ok = {loc.key for loc, _ in good}
        return [s.key in ok for s in slots]

    @never_raises("abort_slots (the slots are reclaimed when this process ends)", lambda *_: None)
    def abort_slots(self, slots: Sequence[Slot]) -> None:
        self.slot_books().finish([], [_loc_of(s) for s in slots])

    @never_raises("pin_slots", _none_each)
    def pin_slots(self, keys: Sequence[bytes]) -> list[Slot | None]:
        """Committed blocks' slots with their stored checksum (not held: see `SlotStore`)."""
        books = self.slot_books()
        locs = books.locate(list(keys))
        books.stats.misses += sum(k not in locs for k in keys)
        return [_slot_of(books, locs[k], locs[k].csum) if k in locs else None for k in keys]

    @never_raises("unpin_slots", lambda *_: None)
    def unpin_slots(self, slots: Sequence[Slot], ok: Sequence[bool] | None = None) -> None:
        stats = self.slot_books().stats
        for n, s in enumerate(slots):
            if ok is None or ok[n]:
                stats.hits += 1
                stats.bytes_read += s.length


__all__ = ["SlotAccess", "SlotBooks"]
