"""Test doubles with failure switches: stores that fail chosen keys on purpose.

Primitive: `FaultyMemoryStore(capacity, reserve=0)`, the DRAM tier with two switches: keys in
`fail_writes` are refused (`put_many` False and counted as skipped, `reserve_slots` None), keys in
`fail_reads` miss (`get_many` False, `pin_slots` None, counted as misses). Everything else is the
real `MemoryStore`. Used by tests and benches only; the production tier has no switches.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

from offload.store.base import Buffer, Slot
from offload.store.memory.store import MemoryStore

R = TypeVar("R")


def _merge(keys: Sequence[bytes], failing: set[bytes], refused: R, rest: list[R]) -> list[R]:
    it = iter(rest)
    return [refused if k in failing else next(it) for k in keys]


class FaultyMemoryStore(MemoryStore):
    def __init__(self, capacity: int = 1 << 30, reserve: int = 0):
        super().__init__(capacity, reserve)
        self.fail_reads: set[bytes] = set()
        self.fail_writes: set[bytes] = set()

    def _count(self, skipped: int = 0, misses: int = 0) -> None:
        with self._lock:
            self._stats.put_skipped += skipped
            self._stats.misses += misses

    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]) -> list[bool]:
        fw = set(self.fail_writes)
        ok = [(k, b) for k, b in zip(keys, blocks) if k not in fw]
        self._count(skipped=len(keys) - len(ok))
        rest = super().put_many([k for k, _ in ok], [b for _, b in ok]) if ok else []
        return _merge(keys, fw, False, rest)

    def reserve_slots(self, keys: Sequence[bytes], sizes: Sequence[int]) -> list[Slot | None]:
        fw = set(self.fail_writes)
        ok = [(k, n) for k, n in zip(keys, sizes) if k not in fw]
        rest = super().reserve_slots([k for k, _ in ok], [n for _, n in ok]) if ok else []
        return _merge(keys, fw, None, rest)

    def get_many(self, keys: Sequence[bytes], dests: Sequence[Sequence[Buffer]]) -> list[bool]:
        fr = set(self.fail_reads)
        ok = [(k, d) for k, d in zip(keys, dests) if k not in fr]
        self._count(misses=len(keys) - len(ok))
        rest = super().get_many([k for k, _ in ok], [d for _, d in ok]) if ok else []
        return _merge(keys, fr, False, rest)

    def pin_slots(self, keys: Sequence[bytes]) -> list[Slot | None]:
        fr = set(self.fail_reads)
        ok = [k for k in keys if k not in fr]
        self._count(misses=len(keys) - len(ok))
        rest = super().pin_slots(ok) if ok else []
        return _merge(keys, fr, None, rest)
