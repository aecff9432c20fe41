"""Where one block lies (segment, slot, length, checksum), a slot's address (`SlotAddr`) and the slot
geometry (4 KiB alignment).

The one leaf both halves of the disk store share: `index/` stores locations in its rows, `slab/`
reads and writes the bytes at them. Imports nothing of either.
"""
from __future__ import annotations

from dataclasses import dataclass

ALIGN = 4096          # every slot, header and data length is 4 KiB-aligned (O_DIRECT)
HEADER_BYTES = ALIGN  # a slot's header (its layout: `slab/format.py`)

# One slot of the slab files by its address, as the index's tables name it: (slot_bytes, seg,
# slot). Not `offload.store.base.Slot` (a block's bytes handed to a mover), nor a slot number
# (`Location.slot`, the index of a slot in its segment).
SlotAddr = tuple[int, int, int]


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def slot_bytes_for(length: int) -> int:
    """The size of the slot that holds a block of `length` bytes: its header, then the data padded."""
    return HEADER_BYTES + align_up(length)


@dataclass(frozen=True)
class Location:
    key: bytes
    seg: int
    slot: int
    slot_bytes: int
    length: int
    csum: int
    created: float = 0.0   # the row's generation (allocation time): cleanup matches it
