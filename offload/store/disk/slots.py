"""DiskStore's `SlotStore` side (medium "file"), for paths that move a block's bytes themselves
(GDS: GPU memory <-> NVMe by DMA).

Primitives:
- `SlotBooks`: what the disk store lends its slot access — its slab files, its stats, and three
  bookkeeping calls that take the store's locks themselves (`allocate`, `finish`, `locate`).
- `Slots(state, commits, finish)`: the `SlotStore` methods behind `DiskStore`'s (which guards
  them: `never_raises`); they reach the store only through `books()` (built here from the shared
  state, the committer and the slot path's commit, `Finish.commit_written`).
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
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from offload.store.base import Slot, StoreStats
from offload.store.disk.commit import BUSY as COMMIT_BUSY
from offload.store.disk.commit import Committer
from offload.store.disk.finish import Finish
from offload.store.disk.index.access import BUSY
from offload.store.disk.index.db import Allocation, Index, Location
from offload.store.disk.slab import files as slab
from offload.store.disk.slab import format as slot_format
from offload.store.disk.state import DiskState

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


def _file_wsum64(s: Slot) -> int:
    """The checksum of a slot's bytes as written in its file (a committer that gave none)."""
    fd = os.open(s.path, os.O_RDONLY)
    try:
        return slot_format.wsum64([os.pread(fd, s.length, s.offset)])
    finally:
        os.close(fd)


class Slots:
    def __init__(self, state: DiskState, commits: Committer, finish: Finish):
        self.state, self.commits, self.finish = state, commits, finish

    def books(self) -> SlotBooks:
        """What the store lends: its bookkeeping under its own locks and deadlines."""
        return SlotBooks(self.state.slabs, self.state.stats, self._allocate, self._finish,
                         self._locate)

    def _allocate(self, items: list[tuple[bytes, int]]) -> list[Location]:
        st = self.state
        with st.lock:
            if not st.refresh_keys():
                return []
            todo = [(k, n, slot_format.slot_bytes_for(n), 0) for k, n in items
                    if k not in st.keys and not self.commits.in_flight(k)]
        alloc = st.ix.write(self._allocation(todo)) if todo else BUSY
        return alloc.new if isinstance(alloc, Allocation) else []

    def _allocation(self, items: list[tuple[bytes, int, int, int]]
                    ) -> Callable[[Index], Allocation]:
        """Reserve slots (under the write lock; the key set refreshed)."""
        st = self.state

        def run(index: Index) -> Allocation:
            st.drop_missing(index)
            alloc = index.allocate(
                items, st.owner, high=st.cfg.high_watermark, low=st.cfg.low_watermark,
                free_bytes=lambda: st.free_bytes(st.directory), min_free=st.cfg.min_free,
                segment_size=st.cfg.segment_size, create_segment=st.slabs.create,
                free_slot=st.free_slot, release=st.orphans)
            st.orphans = []
            st.evicted(alloc.evicted)
            st.drop_missing(index)
            return alloc
        return run

    def _finish(self, good: list[tuple[Location, int]], failed: list[Location]) -> bool:
        """Commit / free slots written (and synced) by another path: False if not committed
        (the slots are then freed, at the latest by the next reservation)."""
        st = self.state
        why = self.finish.commit_written(good, failed)
        if why == COMMIT_BUSY:
            with st.ix.wlock:
                st.orphans += [loc for loc, _ in good] + failed
            return False
        if not why:
            with st.lock:
                st.keys.update(loc.key for loc, _ in good)
        return not why

    def _locate(self, keys: list[bytes]) -> dict[bytes, Location]:
        with self.state.lock:
            return self.state.ix.reader.locate(keys)

    def reserve_slots(self, keys: Sequence[bytes], sizes: Sequence[int]) -> list[Slot | None]:
        """Slots for blocks not stored yet (None: already stored, in flight, or no room)."""
        books = self.books()
        seen: set[bytes] = set()
        items = []
        for k, n in zip(keys, sizes):
            if k not in seen:
                seen.add(k)
                items.append((k, n))
        out: dict[bytes, Slot] = {}
        failed = []
        for loc in books.allocate(items) if items else []:
            room = books.slabs.reserve_space(loc.seg, loc.slot_bytes, loc.slot)
            if not room.ok:
                log.warning("slot for %s not reserved: %s", loc.key.hex()[:16], room.reason)
                failed.append(loc)
            else:
                out[loc.key] = _slot_of(books, loc)
        if failed:
            books.finish([], failed)
        return [out.pop(k, None) for k in keys]

    def commit_slots(self, slots: Sequence[Slot], checksums: Sequence[int] | None = None
                     ) -> list[bool]:
        """Headers (checksum kind WSUM64) -> fdatasync -> visible. One flag per slot."""
        books = self.books()
        sums = list(checksums) if checksums is not None else [_file_wsum64(s) for s in slots]
        locs = [_loc_of(s) for s in slots]
        now = time.time_ns()
        headers = [books.slabs.write_header(loc.seg, loc.slot_bytes, loc.slot, loc.key,
                                            loc.length, c, now, slot_format.CSUM_WSUM64)
                   for loc, c in zip(locs, sums)]
        segs = {(loc.seg, loc.slot_bytes) for loc, h in zip(locs, headers) if h.ok}
        synced = {sg: books.slabs.sync(*sg) for sg in segs}
        good, bad = [], []
        for loc, c, h in zip(locs, sums, headers):
            if not h.ok or not synced[(loc.seg, loc.slot_bytes)]:
                bad.append(loc)
            else:
                good.append((loc, c))
        if not books.finish(good, bad):
            return [False] * len(slots)
        books.stats.puts += len(good)
        books.stats.bytes_written += sum(loc.length for loc, _ in good)
        ok = {loc.key for loc, _ in good}
        return [s.key in ok for s in slots]

    def abort_slots(self, slots: Sequence[Slot]) -> None:
        self.books().finish([], [_loc_of(s) for s in slots])

    def pin_slots(self, keys: Sequence[bytes]) -> list[Slot | None]:
        """Committed blocks' slots with their stored checksum (not held: see `SlotStore`)."""
        books = self.books()
        locs = books.locate(list(keys))
        books.stats.misses += sum(k not in locs for k in keys)
        return [_slot_of(books, locs[k], locs[k].csum) if k in locs else None for k in keys]

    def unpin_slots(self, slots: Sequence[Slot], ok: Sequence[bool] | None = None) -> None:
        stats = self.books().stats
        for n, s in enumerate(slots):
            if ok is None or ok[n]:
                stats.hits += 1
                stats.bytes_read += s.length


__all__ = ["SlotBooks", "Slots"]
