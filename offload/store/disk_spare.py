"""A disk store's reserved range: slots its next puts take without an index transaction.

`Index.reserve` hands a process slots ahead (rows of `reserved`, owned by it, counted against the
capacity: `index_alloc.py`). The process keeps the ones not written yet here, per slot size, in
slab order (so a batch gets consecutive slots and is written in few calls). Guarded by the store's
state lock. They go back to the index on close (as they are: never written), are reclaimed by
the next open if the process dies, and are forgotten when the index is rebuilt by another process
(the new index holds no reservation of ours) or their slab is dropped.

Sizing: a reservation asks for what the put needs plus up to `RANGE_BYTES` (or a `RANGE_SHARE`th
of the capacity, or one slab file, if less) ahead, and gets the part ahead only from room under the
high watermark: it never evicts a block for slots nobody asked for yet. Slots held ahead by other
processes count against the cap, so a small cache shared by many processes keeps most of it for
blocks: eight processes hold at most an eighth per slot size.
"""

from __future__ import annotations

import bisect

RANGE_BYTES = 256 << 20   # slots reserved ahead per slot size: one index transaction per ~256 MiB
RANGE_SHARE = 64          # ... and at most this fraction of the capacity (8 TP ranks: 1/8)


class Spare:
    def __init__(self) -> None:
        self._by_size: dict[int, list[tuple[int, int]]] = {}

    def take(self, slot_bytes: int, n: int) -> list[tuple[int, int]]:
        """Up to n (seg, slot) of that size, the lowest first."""
        have = self._by_size.get(slot_bytes, [])
        out, self._by_size[slot_bytes] = have[:n], have[n:]
        return out

    def add(self, slots: dict[int, list[tuple[int, int]]]) -> None:
        for sb, more in slots.items():
            have = self._by_size.setdefault(sb, [])
            for s in more:
                bisect.insort(have, s)

    def drop_segment(self, seg: int) -> None:
        for sb, have in self._by_size.items():
            self._by_size[sb] = [s for s in have if s[0] != seg]

    def clear(self) -> list[tuple[int, int, int]]:
        """Every slot held, as (slot_bytes, seg, slot); the range is empty after."""
        out = [(sb, seg, slot) for sb, have in self._by_size.items() for seg, slot in have]
        self._by_size = {}
        return out

    def nbytes(self) -> int:
        return sum(sb * len(have) for sb, have in self._by_size.items())


__all__ = ["RANGE_BYTES", "RANGE_SHARE", "Spare"]
