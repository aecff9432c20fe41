"""Re-reading every committed block of a disk store (`sglang-offload cache verify`).

`scan(slabs, pool, page, drop, progress)`: pages through the committed blocks in key order
(`page(after_key)` -> the next locations, none at the end), reads and verifies each on the I/O
threads, and hands every failure to `drop(location, corrupt)`, which deletes a corrupt block only if the
index still holds it and a re-read under the write lock still finds it corrupt
(`DiskState.drop_bad`, using `read_whole`), and says whether it is bad (a block deleted, evicted
or rewritten meanwhile by another process is not). An I/O error is only reported, never a reason
to delete. Returns (blocks checked, [(key, outcome)] of the bad ones: each a `ReadOutcome`,
corrupt or failed).

Nothing is allocated from an untrusted length: the page's rows passed the index's range checks
(length within its slot's size class), and a slot must lie inside its slab file (fstat) before
a buffer of its length is made; a slot past the end is corrupt without reading it.
"""

from __future__ import annotations

import os
from concurrent.futures import Executor
from typing import Callable

from offload.store.disk.location import Location
from offload.store.disk.slab import files as slab
from offload.store.disk.slab.format import ReadOutcome, corrupt


def scan(slabs: slab.SlabFiles, pool: Executor, page: Callable[[bytes], list[Location]],
         drop: Callable[[Location, bool], bool],
         progress: Callable[[int], None] | None = None
         ) -> tuple[int, list[tuple[bytes, ReadOutcome]]]:
    checked, after = 0, b""
    bad: list[tuple[bytes, ReadOutcome]] = []

    def read(loc: Location) -> ReadOutcome:
        return read_whole(slabs, loc)

    while True:
        locs = page(after)
        if not locs:
            break
        after = locs[-1].key
        for loc, got in zip(locs, pool.map(read, locs)):
            if not got.ok and drop(loc, got.corrupt):
                bad.append((loc.key, got))
        checked += len(locs)
        if progress is not None:
            progress(len(locs))
    return checked, bad


def read_whole(slabs: slab.SlabFiles, loc: Location) -> ReadOutcome:
    """Read and verify one block into a buffer of its own (a slot past its slab's end is corrupt
    without allocating one): `cache verify`'s read, and the re-read that decides a block is bad
    (`DiskState.drop_bad`)."""
    try:
        with slabs.use(loc.seg, loc.slot_bytes) as fd:
            size = os.fstat(fd).st_size
    except OSError as e:
        return slab.read_error(e)
    if (loc.slot + 1) * loc.slot_bytes > size:
        return corrupt(f"slot {loc.slot} lies past the end of its slab ({size} bytes)")
    return slabs.read_block(loc.seg, loc.slot_bytes, loc.slot, loc.key, loc.length, loc.csum,
                            [bytearray(loc.length)])


__all__ = ["read_whole", "scan"]
