"""Slot access for paths that move a block's bytes themselves (GDS: GPU memory <-> NVMe by DMA).

`SlotAccess` is mixed into `DiskStore`. A path reserves slots (`reserve_slots`: 4 KiB-aligned data
areas inside slab files, counted against the cap like any put), writes the data with its own engine,
then `commit_slots` writes each slot's header with the checksum the path computed (kind WSUM64,
verified on the CPU by `slab.wsum64` when such a block is read through the ordinary path),
fdatasyncs and makes the blocks visible — or `abort_slots` frees them. `locate_many` gives the
slots of committed blocks with their stored checksum, for reads by the same engine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from offload.store import slab
from offload.store.index import Location

if TYPE_CHECKING:
    from offload.store.disk import DiskStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Slot:
    key: bytes
    path: str          # slab file
    offset: int        # where the block's data starts (4 KiB aligned)
    length: int
    checksum: int = 0  # stored checksum (locate_many), 0 when reserving
    token: int = 0     # the slot's segment id


def _slot_of(store: "DiskStore", loc: Location, checksum: int = 0) -> Slot:
    return Slot(loc.key, store._slabs.path(loc.seg, loc.slot_bytes),
                loc.slot * loc.slot_bytes + slab.HEADER_BYTES, loc.length, checksum, loc.seg)


def _loc_of(s: Slot) -> Location:
    parsed = slab.parse_segment_name(s.path.rsplit("/", 1)[-1])
    if parsed is None:
        raise ValueError(f"not a slab file: {s.path}")
    seg, sb = parsed
    return Location(s.key, seg, (s.offset - slab.HEADER_BYTES) // sb, sb, s.length, s.checksum)


class SlotAccess:
    def reserve_slots(self: "DiskStore", keys: Sequence[bytes],  # type: ignore[misc]
                      sizes: Sequence[int]) -> list[Slot | None]:
        """Slots for blocks not stored yet (None: already stored, in flight, or no room)."""
        try:
            with self._lock:
                self._refresh_keys()
                seen: set[bytes] = set()
                items = []
                for k, n in zip(keys, sizes):
                    if k not in self._keys and k not in seen:
                        seen.add(k)
                        items.append((k, n, slab.slot_bytes_for(n), 0))
                alloc = self._allocate(items) if items else None
            out: dict[bytes, Slot] = {}
            failed = []
            for loc in alloc.new if alloc else []:
                err = self._slabs.reserve_space(loc.seg, loc.slot_bytes, loc.slot)
                if err:
                    log.warning("slot for %s not reserved: %s", loc.key.hex()[:16], err)
                    failed.append(loc)
                else:
                    out[loc.key] = _slot_of(self, loc)
            if failed:
                with self._lock:
                    self._index.finish([], failed, [], self._free_slot)
            return [out.pop(k, None) for k in keys]
        except Exception:  # noqa: BLE001 - data path
            log.exception("reserve_slots failed")
            return [None] * len(keys)

    def commit_slots(self: "DiskStore", slots: Sequence[Slot],  # type: ignore[misc]
                     checksums: Sequence[int]) -> list[bool]:
        """Headers (checksum kind WSUM64) -> fdatasync -> visible. One flag per slot."""
        try:
            locs = [_loc_of(s) for s in slots]
            now = time.time_ns()
            errs = [self._slabs.write_header(loc.seg, loc.slot_bytes, loc.slot, loc.key,
                                             loc.length, c, now, slab.CSUM_WSUM64)
                    for loc, c in zip(locs, checksums)]
            segs = {(loc.seg, loc.slot_bytes) for loc, e in zip(locs, errs) if not e}
            synced = {sg: self._slabs.sync(*sg) for sg in segs}
            good, bad = [], []
            for loc, c, e in zip(locs, checksums, errs):
                if e or not synced[(loc.seg, loc.slot_bytes)]:
                    bad.append(loc)
                else:
                    good.append((loc.key, c))
            with self._lock:
                self._index.finish(good, bad, [], self._free_slot)
                self._keys.update(k for k, _ in good)
            self._stats.puts += len(good)
            self._stats.bytes_written += sum(loc.length for loc in locs) if not bad else 0
            ok = {k for k, _ in good}
            return [s.key in ok for s in slots]
        except Exception:  # noqa: BLE001
            log.exception("commit_slots failed")
            self.abort_slots(slots)
            return [False] * len(slots)

    def abort_slots(self: "DiskStore", slots: Sequence[Slot]) -> None:  # type: ignore[misc]
        try:
            with self._lock:
                self._index.finish([], [_loc_of(s) for s in slots], [], self._free_slot)
        except Exception:  # noqa: BLE001
            log.exception("abort_slots failed (the slots are reclaimed when this process ends)")

    def locate_many(self: "DiskStore",  # type: ignore[misc]
                    keys: Sequence[bytes]) -> list[Slot | None]:
        try:
            with self._lock:
                locs = self._index.locate(list(keys))
            return [_slot_of(self, locs[k], locs[k].csum) if k in locs else None for k in keys]
        except Exception:  # noqa: BLE001
            log.exception("locate_many failed")
            return [None] * len(keys)
