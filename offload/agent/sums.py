"""End-to-end checksums of the bytes NIXL moves between a host's memory and the agent.

The control channel is MAC'd, the bytes NIXL moves are not: anyone who can alter UCX-over-TCP
traffic, or a faulty NIC path, could change a block on its way. So each block's checksum (the
store's own, xxh3-64: `offload.store.disk.slab.format.checksum`) travels in the authenticated frame
beside it: the host sends it with a PUT (`Blocks.sums`) and the agent checks what its READ
landed before acknowledging the block; the agent sends it with a GET reply (`Flags.sums`) and
the host checks what the WRITE landed before reporting the page loaded. A mismatch is a miss
(never stored, never loaded), counted (`checksum_mismatch_in` on the agent, `get_mismatch` on the
host).

Primitives: `of_regions(regions)` -> the checksum of the bytes at (address, length) regions of
this process (a block's descriptors), `of_views(views)`.
"""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

from offload.store.disk.slab.format import checksum


def of_views(views: Sequence[Any]) -> int:
    return checksum(list(views))


def of_regions(regions: Sequence[tuple[int, int]]) -> int:
    """The checksum of the bytes at each (address, length) of this process's memory, in order."""
    return checksum([memoryview((ctypes.c_char * n).from_address(a)).cast("B")
                     for a, n in regions if n])
