"""A disk store's reserved range: slots its next puts take without an index transaction.

`Index.reserve` hands a process slots ahead (rows of `reserved`, owned by it, counted against the
capacity: `disk/index/alloc.py`). The process keeps the ones not written yet here, per slot size, in
slab order (so a batch gets consecutive slots and is written in few calls). Guarded by the store's
state lock. They go back to the index on close (as they are: never written), are reclaimed by
the next open if the process dies, and are forgotten when the index is rebuilt by another process
(the new index holds no reservation of ours) or their slab is dropped.

Sizing (what a process writes, not a fixed amount): the first reservation of a slot size asks for
what the put needs plus as much again ahead; each later one (the range of that size ran out) asks
for twice the previous part ahead, up to `RANGE_BYTES` (or a `RANGE_SHARE`th of the capacity, or
one slab file, if less). So a process writing one block of a size holds two slots of it, and one
streaming a size reaches one index transaction per ~256 MiB after a few. The part ahead comes only
from room under the high watermark (it never evicts a block for slots nobody asked for yet); the
cap counts it (so it holds for every process together, blocks in flight included) but `stats()`
and `cache stats` report it apart from what is stored. Given back: a size's range unused for
`IDLE_S` (with the next reservation), the whole range when a reservation would otherwise evict a
stored block (air before data), and everything on close.
"""

from __future__ import annotations

import bisect
import time

RANGE_BYTES = 256 << 20   # at most this many bytes ahead per slot size (one transaction per ~256 MiB)
RANGE_SHARE = 64          # ... and at most this fraction of the capacity
IDLE_S = 10.0             # a slot size's range unused this long goes back with the next reservation


class Spare:
    def __init__(self) -> None:
        self._by_size: dict[int, list[tuple[int, int]]] = {}
        self._used_at: dict[int, float] = {}    # slot size -> monotonic time of its last take
        self.ahead: dict[int, int] = {}         # slot size -> slots asked ahead last time

    def take(self, slot_bytes: int, n: int) -> list[tuple[int, int]]:
        """Up to n (seg, slot) of that size, the lowest first."""
        have = self._by_size.get(slot_bytes, [])
        out, self._by_size[slot_bytes] = have[:n], have[n:]
        self._used_at[slot_bytes] = time.monotonic()
        return out

    def add(self, slots: dict[int, list[tuple[int, int]]]) -> None:
        for sb, more in slots.items():
            have = self._by_size.setdefault(sb, [])
            for s in more:
                bisect.insort(have, s)

    def ask_ahead(self, slot_bytes: int, n: int, limit: int) -> int:
        """Slots to reserve ahead for a put short of `n` slots of this size: n, then twice the
        last part ahead, at most `limit`."""
        got = min(limit, max(n, 2 * self.ahead.get(slot_bytes, 0)))
        self.ahead[slot_bytes] = got
        return got

    def take_idle(self, idle_s: float = IDLE_S) -> list[tuple[int, int, int]]:
        """Every slot of sizes not taken from for `idle_s`, as (slot_bytes, seg, slot); their
        growth starts again from small."""
        now = time.monotonic()
        idle = [sb for sb, have in self._by_size.items()
                if have and now - self._used_at.get(sb, now) >= idle_s]
        out = [(sb, seg, slot) for sb in idle for seg, slot in self._by_size.pop(sb)]
        for sb in idle:
            self.ahead.pop(sb, None)
        return out

    def drop_segment(self, seg: int) -> None:
        for sb, have in self._by_size.items():
            self._by_size[sb] = [s for s in have if s[0] != seg]

    def clear(self) -> list[tuple[int, int, int]]:
        """Every slot held, as (slot_bytes, seg, slot); the range is empty after."""
        out = [(sb, seg, slot) for sb, have in self._by_size.items() for seg, slot in have]
        self._by_size = {}
        return out

    def put_back(self, slots: list[tuple[int, int, int]]) -> None:
        """Slots of `clear` kept after all."""
        by: dict[int, list[tuple[int, int]]] = {}
        for sb, seg, slot in slots:
            by.setdefault(sb, []).append((seg, slot))
        self.add(by)

    def nbytes(self) -> int:
        return sum(sb * len(have) for sb, have in self._by_size.items())


__all__ = ["IDLE_S", "RANGE_BYTES", "RANGE_SHARE", "Spare"]
