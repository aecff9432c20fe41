"""Re-reading every committed block of a disk store (`sglang-offload cache verify`).

`scan(slabs, pool, page, drop, progress)`: pages through the committed blocks in key order
(`page(after_key)` -> the next locations, none at the end), reads and verifies each on the I/O
threads, and hands every failure to `drop(location, corrupt)`, which deletes a corrupt block and
says whether the index still held it (a block deleted or evicted meanwhile by another process is
not bad). An I/O error is only reported, never a reason to delete. Returns (blocks checked,
[(key, why)] of the bad ones).

Nothing is allocated from an untrusted length: the page's rows passed the index's range checks
(length within its slot's size class), and a slot must lie inside its slab file (fstat) before
a buffer of its length is made; a slot past the end is corrupt without reading it.
"""

from __future__ import annotations

import os
from concurrent.futures import Executor
from typing import Callable

from offload.store import slab
from offload.store.index import Location


def scan(slabs: slab.SlabFiles, pool: Executor, page: Callable[[bytes], list[Location]],
         drop: Callable[[Location, bool], bool],
         progress: Callable[[int], None] | None = None) -> tuple[int, list[tuple[bytes, str]]]:
    checked, bad, after = 0, [], b""

    def read(loc: Location) -> str:
        try:
            with slabs.use(loc.seg, loc.slot_bytes) as fd:
                size = os.fstat(fd).st_size
        except OSError as e:
            return slab.reason(e, "io error ")
        if (loc.slot + 1) * loc.slot_bytes > size:
            return f"corrupt: slot {loc.slot} lies past the end of its slab ({size} bytes)"
        return slabs.read_block(loc.seg, loc.slot_bytes, loc.slot, loc.key, loc.length, loc.csum,
                                [bytearray(loc.length)])

    while True:
        locs = page(after)
        if not locs:
            break
        after = locs[-1].key
        for loc, err in zip(locs, pool.map(read, locs)):
            if err and drop(loc, err.startswith("corrupt")):
                bad.append((loc.key, err))
        checked += len(locs)
        if progress is not None:
            progress(len(locs))
    return checked, bad


__all__ = ["scan"]
