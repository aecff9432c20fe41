"""Coalesced slab I/O: consecutive slots of one segment moved with one pwritev / preadv.

A batch of puts usually gets consecutive slots, and a batch of gets of one prefix usually reads
them back in order. Writing eight 2 MiB slots as one 16 MiB vectored call (header, data, header,
data, ...) instead of eight calls keeps the device at its sequential bandwidth. A run is used only
when every buffer is 4 KiB aligned and every block fills its slot exactly (no padding, no bounce);
anything else goes block by block through `SlabFiles.write_block` / `read_block`.

Primitives: `plan_runs(locations)` -> lists of locations to move together; `write_run` /
`read_run` -> one reason string per block ('' = ok), never raising.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Sequence

from offload.store import slab
from offload.store.base import Buffer
from offload.store.index import Location

RUN_BYTES = 16 << 20  # about where a single stream reaches the device's sequential bandwidth


class _Headers(threading.local):
    def __init__(self) -> None:
        self.buf: mmap.mmap | None = None

    def get(self, n: int) -> mmap.mmap:
        if self.buf is None or len(self.buf) < n * slab.HEADER_BYTES:
            self.buf = mmap.mmap(-1, max(n, 8) * slab.HEADER_BYTES)
        return self.buf


_headers = _Headers()


def plan_runs(locs: Sequence[Location], bufs: Sequence[Sequence[Buffer]],
              threads: int = 1) -> list[list[int]]:
    """Indices of `locs` grouped into runs of consecutive, exactly-filled, aligned slots.

    A run holds at most RUN_BYTES and at most its share of the batch over `threads`, so a small
    batch still keeps every I/O thread (and the device queue) busy.
    """
    share = max(1, -(-len(locs) // max(1, threads)))
    runs: list[list[int]] = []
    joinable = False  # whether the last run may grow
    nbuf = 0
    for i in sorted(range(len(locs)), key=lambda i: (locs[i].seg, locs[i].slot)):
        loc = locs[i]
        fits = loc.length + slab.HEADER_BYTES == loc.slot_bytes and slab._aligned(bufs[i])
        if fits and joinable:
            prev = locs[runs[-1][-1]]
            if (prev.seg == loc.seg and prev.slot + 1 == loc.slot
                    and (len(runs[-1]) + 1) * loc.slot_bytes <= RUN_BYTES
                    and len(runs[-1]) < share
                    and nbuf + 1 + len(bufs[i]) < slab.IOV_MAX):
                runs[-1].append(i)
                nbuf += 1 + len(bufs[i])
                continue
        runs.append([i])
        joinable, nbuf = fits, 1 + len(bufs[i])
    return runs


def write_run(slabs: slab.SlabFiles, locs: Sequence[Location], bufs: Sequence[Sequence[Buffer]],
              csums: Sequence[int], created_ns: int) -> list[str]:
    """Write consecutive slots in one call. One reason per block ('' = written)."""
    first = locs[0]
    hdrs = _headers.get(len(locs))
    iov: list[Buffer] = []
    for j, (loc, b, c) in enumerate(zip(locs, bufs, csums)):
        hdr = memoryview(hdrs)[j * slab.HEADER_BYTES:(j + 1) * slab.HEADER_BYTES]
        packed = slab.pack_header(loc.key, loc.length, c, created_ns)
        hdr[:len(packed)] = packed
        hdr[len(packed):] = bytes(slab.HEADER_BYTES - len(packed))
        iov.append(hdr)
        iov.extend(b)
    want = len(locs) * first.slot_bytes
    try:
        with slabs.use(first.seg, first.slot_bytes) as fd:
            n = os.pwritev(fd, iov, first.slot * first.slot_bytes)
    except OSError as e:
        return [slab.reason(e)] * len(locs)
    if n == want:
        return [""] * len(locs)
    whole = n // first.slot_bytes  # the slots fully written before the short write stopped
    return ["" if j < whole else f"short write ({n} of {want} bytes)" for j in range(len(locs))]


def read_run(slabs: slab.SlabFiles, locs: Sequence[Location],
             dests: Sequence[Sequence[Buffer]]) -> list[str]:
    """Read consecutive slots in one call, then verify each block. One reason per block."""
    first = locs[0]
    hdrs = _headers.get(len(locs))
    iov: list[Buffer] = []
    for j, d in enumerate(dests):
        iov.append(memoryview(hdrs)[j * slab.HEADER_BYTES:(j + 1) * slab.HEADER_BYTES])
        iov.extend(d)
    try:
        with slabs.use(first.seg, first.slot_bytes) as fd:
            n = os.preadv(fd, iov, first.slot * first.slot_bytes)
    except OSError as e:
        return [slab.reason(e, "io error ")] * len(locs)
    out = []
    for j, (loc, d) in enumerate(zip(locs, dests)):
        if n < (j + 1) * first.slot_bytes:
            out.append(f"corrupt: short read ({n} bytes for {len(locs)} slots)")
            continue
        raw = memoryview(hdrs)[j * slab.HEADER_BYTES:(j + 1) * slab.HEADER_BYTES]
        out.append(slab.verify(raw, loc.key, loc.length, loc.csum, d))
    return out
