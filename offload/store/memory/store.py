"""In-memory block store: the DRAM tier (and, as `MemoryStore()`, the plain fake the tests use;
the one with failure switches is `offload.store.faults.FaultyMemoryStore`).

Primitives: `MemoryStore(capacity, reserve=0)` implementing `BlockStore`.
Lifecycle: construct with a capacity; blocks are evicted least-recently-used past it; `close()`
stops the reserve thread. Not shared between processes.

Memory: each block lives in one slot, written with one copy (large copies release the GIL, so the
agent's NIXL thread keeps moving bytes meanwhile). Slots of evicted or deleted blocks are kept by
size and reused (the blocks of one deployment all have the same size), so that a full store copies
into memory already in use instead of faulting in new pages (about 5x slower on small VMs).
With `reserve > 0` (the agent's DRAM tier) slots are carved from one arena of `capacity` bytes of
address space that a background thread keeps faulted in `reserve` bytes ahead of the fill point
(`offload.store.memory.arena`), so that a burst of puts into an empty tier costs no page faults either.
Memory held (blocks, kept slots, the faulted-in reserve) stays within `capacity`: kept slots of
other sizes are given back when a new size needs room.

Every block carries the store's per-block checksum (xxh3-64, `offload.store.checksum`), taken when
it is stored (after the copy, or from the slot at `commit_slots`) and verified before it is served
(`get_many`, `pin_slots`): a mismatch is a miss, counted (`checksum_failures`), and the block is
dropped with its slot (never reused: whatever wrote into it may not be done).

`SlotStore` (medium "memory", for zero-copy movers such as the agent's NIXL path):
`reserve_slots(keys, sizes)` hands out slots for new blocks, invisible until `commit_slots` (or
freed by `abort_slots`); `pin_slots(keys)` hands out stored blocks' slots, which eviction skips
and deletion does not reuse until `unpin_slots`. `arena_region()` is the arena's (address, length).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import OrderedDict
from typing import Sequence

from offload.keys import KEY_BYTES, Namespace
from offload.store.base import Buffer, Slot, SlotMedium, StoreStats, total_len
from offload.store.checksum import checksum
from offload.store.memory.arena import ReservedArena, pages

log = logging.getLogger(__name__)

_NUMPY_FROM = 64 << 10       # copies at least this large go through numpy, which frees the GIL


def _copy(dst: memoryview, src: memoryview) -> None:
    """dst[:] = src. A memoryview copy holds the GIL for its whole length; numpy's does not, so
    a large copy here runs alongside the agent's NIXL thread instead of stalling it."""
    if dst.nbytes < _NUMPY_FROM:
        dst[:] = src
        return
    import numpy as np

    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


class MemoryStore:
    slot_medium: SlotMedium = "memory"

    def __init__(self, capacity: int = 1 << 30, reserve: int = 0):
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, memoryview] = OrderedDict()
        self._sums: dict[bytes, int] = {}   # key -> checksum of its block (taken when stored)
        self._used = 0                      # bytes of stored blocks (what the cap counts)
        self._free: dict[int, list[memoryview]] = {}   # reusable slots by block size
        self._free_bytes = 0                # memory held by those slots
        self._lock = threading.Lock()
        self._stats = StoreStats(capacity=capacity)
        self._recycled = 0
        self._reserved: dict[bytes, memoryview] = {}    # reserved, uncommitted slots
        self._pins: dict[bytes, list] = {}              # key -> [count, slot]
        # The arena (reserve > 0, Linux): slots carved from one mapping, faulted in ahead.
        reserve = pages(min(reserve, capacity))
        self._arena = (ReservedArena(capacity, reserve, self._lock)
                       if reserve > 0 and sys.platform.startswith("linux") else None)
        self.namespaces: dict[bytes, dict[str, object]] = {}

    def wait_reserve(self, timeout: float) -> bool:
        """Block until the reserve is faulted in (start-up of a DRAM tier sized to be preallocated:
        its first puts then copy without page faults). False if `timeout` passed first."""
        return self._arena.wait_ready(timeout) if self._arena is not None else True

    # ---------------------------------------------------------------- slots (lock held)
    def _held_bytes(self) -> int:
        """Memory held besides stored blocks: kept slots and the arena's uncarved part."""
        return self._free_bytes + (self._arena.spare() if self._arena is not None else 0)

    def _release(self, slot: memoryview) -> None:
        """Keep a slot whose block left the store, for the next block of its size."""
        self._free.setdefault(slot.nbytes, []).append(slot)
        self._free_bytes += slot.nbytes

    def _drop_free(self, need: int) -> None:
        """Give kept slots back (to the OS) until `need` more bytes fit in the capacity."""
        for size in sorted(self._free, reverse=True):
            slots = self._free[size]
            while slots and self._used + self._held_bytes() + need > self.capacity:
                slot = slots.pop()
                self._free_bytes -= slot.nbytes
                self._forget(slot)
            if not slots:
                del self._free[size]
            if self._used + self._held_bytes() + need <= self.capacity:
                return

    def _forget(self, slot: memoryview) -> None:
        if self._arena is not None:
            self._arena.forget(slot)
        slot.release()

    def _slot(self, size: int) -> memoryview | None:
        """A slot for a block of `size` bytes, once `_used + size <= capacity`."""
        slots = self._free.get(size)
        if slots:
            slot = slots.pop()
            if not slots:
                del self._free[size]
            self._free_bytes -= size
            self._recycled += 1
            return slot
        carved = self._arena.carve(size) if self._arena is not None else None
        if carved is not None:
            return carved
        if self._used + self._held_bytes() + size > self.capacity:
            self._drop_free(size)
        if self._used + self._held_bytes() + size > self.capacity:
            return None
        return memoryview(bytearray(size))

    def _busy(self) -> None:
        if self._arena is not None:
            self._arena.busy()

    def _make_room(self, size: int) -> bool:
        """Evict least-recently-used unpinned blocks until `size` more bytes fit the cap."""
        need = self._used + size - self.capacity
        if need <= 0:
            return True
        victims = []
        for key, slot in self._blocks.items():
            if key not in self._pins:
                victims.append(key)
                need -= slot.nbytes
                if need <= 0:
                    break
        for key in victims:
            self._evict(key)
        return need <= 0

    def _evict(self, key: bytes) -> None:
        old = self._blocks.pop(key)
        self._sums.pop(key, None)
        self._used -= old.nbytes
        self._release(old)
        self._stats.evictions += 1

    def _intact(self, key: bytes, slot: memoryview) -> bool:
        """Whether a stored block still has its checksum; if not it is dropped (and counted),
        its slot given up rather than reused."""
        if checksum([slot]) == self._sums.get(key):
            return True
        log.warning("memory store: block %s fails its checksum; dropped", key.hex()[:16])
        self._stats.checksum_failures += 1
        if self._blocks.get(key) is slot:
            del self._blocks[key]
            self._sums.pop(key, None)
            self._used -= slot.nbytes
            if key not in self._pins:
                self._forget(slot)
        return False

    # ---------------------------------------------------------------- slot API
    def arena_region(self) -> tuple[int, int] | None:
        """(address, length) of the arena every arena slot lies in; None without one."""
        return self._arena.region() if self._arena is not None else None

    def reserve_slots(self, keys: Sequence[bytes], sizes: Sequence[int]) -> list[Slot | None]:
        """Slots to write new blocks into, invisible until committed. None where the key is
        stored or being written already, refused, or does not fit (use put_many for those)."""
        out: list[Slot | None] = []
        with self._lock:
            self._busy()
            for key, size in zip(keys, sizes):
                if (len(key) != KEY_BYTES or key in self._blocks or key in self._reserved
                        or size <= 0 or size > self.capacity):
                    out.append(None)
                    continue
                slot = self._make_room(size) and self._slot(size)
                if not slot:
                    out.append(None)
                    continue
                self._used += size
                self._reserved[key] = slot
                out.append(Slot(key, size, slot))
        return out

    def commit_slots(self, slots: Sequence[Slot], checksums: Sequence[int] | None = None
                     ) -> list[bool]:
        """Publish reserved blocks, each with the checksum of its slot's bytes now (the mover's
        `checksums`, another kind, are not used)."""
        sums = [checksum([s.view]) if s.view is not None else None for s in slots]
        return self._finish(slots, sums)

    def abort_slots(self, slots: Sequence[Slot]) -> None:
        self._finish(slots, None)

    def _finish(self, slots: Sequence[Slot], sums: Sequence[int | None] | None) -> list[bool]:
        """Publish the reserved blocks with their checksums, or (None) free their slots."""
        good = sums is not None
        out = []
        with self._lock:
            for n, s in enumerate(slots):
                key = s.key
                slot = self._reserved.pop(key, None)
                if slot is None:
                    out.append(False)
                    continue
                if sums is not None and sums[n] is not None and key not in self._blocks:
                    self._blocks[key] = slot
                    self._sums[key] = sums[n]       # type: ignore[assignment]
                    self._stats.puts += 1
                    self._stats.bytes_written += slot.nbytes
                    out.append(True)
                    continue
                self._used -= slot.nbytes         # failed, or stored meanwhile by another put
                self._release(slot)
                if not good:
                    self._stats.put_skipped += 1
                out.append(good)
        return out

    def pin_slots(self, keys: Sequence[bytes]) -> list[Slot | None]:
        """Stored blocks' slots, kept from eviction and reuse until unpinned, each checked
        against its checksum first (outside the lock: a pinned slot stays put); None on a
        miss."""
        out: list[Slot | None] = []
        sums: list[int | None] = []
        with self._lock:
            self._busy()
            for key in keys:
                slot = self._blocks.get(key)
                pin = self._pins.get(key)
                if slot is None or (pin is not None and pin[1] is not slot):
                    self._stats.misses += slot is None
                    out.append(None)       # (a pinned slot not this block's: its deleted copy)
                    sums.append(None)
                    continue
                self._blocks.move_to_end(key)
                if pin is None:
                    pin = self._pins[key] = [0, slot]
                pin[0] += 1
                out.append(Slot(key, slot.nbytes, slot))
                sums.append(self._sums.get(key))
        bad = [n for n, s in enumerate(out)
               if s is not None and s.view is not None and checksum([s.view]) != sums[n]]
        if bad:
            self.unpin_slots([out[n] for n in bad], [False] * len(bad))   # type: ignore[misc]
            with self._lock:
                for n in bad:
                    s = out[n]
                    assert s is not None and s.view is not None
                    self._stats.misses += 1
                    self._intact(s.key, s.view)      # fails again: dropped and counted
                    out[n] = None
        return out

    def unpin_slots(self, slots: Sequence[Slot], ok: Sequence[bool] | None = None) -> None:
        """End `pin_slots`; `ok` (per slot) counts the reads that reached their reader."""
        with self._lock:
            for n, s in enumerate(slots):
                key = s.key
                pin = self._pins.get(key)
                if pin is None:
                    continue
                if ok is None or ok[n]:
                    self._stats.hits += 1
                    self._stats.bytes_read += pin[1].nbytes
                pin[0] -= 1
                if pin[0] > 0:
                    continue
                del self._pins[key]
                if self._blocks.get(key) is not pin[1]:     # deleted while pinned
                    self._release(pin[1])

    # ---------------------------------------------------------------- BlockStore
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]) -> list[bool]:
        out = []
        with self._lock:
            self._busy()
            for key, bufs in zip(keys, blocks):
                if len(key) != KEY_BYTES:   # a key is 32 bytes
                    self._stats.put_skipped += 1
                    out.append(False)
                    continue
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    out.append(True)
                    continue
                try:
                    views = [memoryview(b).cast("B") for b in bufs]
                except (TypeError, ValueError):
                    self._stats.put_skipped += 1
                    out.append(False)
                    continue
                size = sum(v.nbytes for v in views)
                if size > self.capacity:
                    self._stats.put_skipped += 1
                    out.append(False)
                    continue
                slot = self._make_room(size) and self._slot(size)
                if not slot:
                    self._stats.put_skipped += 1
                    out.append(False)
                    continue
                pos = 0
                for v in views:
                    _copy(slot[pos:pos + v.nbytes], v)
                    pos += v.nbytes
                self._blocks[key] = slot
                self._sums[key] = checksum([slot])
                self._used += size
                self._stats.puts += 1
                self._stats.bytes_written += size
                out.append(True)
        return out

    def get_many(self, keys: Sequence[bytes], dests: Sequence[Sequence[Buffer]]) -> list[bool]:
        out = []
        with self._lock:
            self._busy()
            for key, bufs in zip(keys, dests):
                slot = self._blocks.get(key)
                if slot is None or total_len(bufs) != slot.nbytes \
                        or not self._intact(key, slot):
                    self._stats.misses += 1
                    out.append(False)
                    continue
                self._blocks.move_to_end(key)
                pos = 0
                for b in bufs:
                    mv = memoryview(b).cast("B")
                    _copy(mv, slot[pos:pos + mv.nbytes])
                    pos += mv.nbytes
                self._stats.hits += 1
                self._stats.bytes_read += slot.nbytes
                out.append(True)
        return out

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._blocks for k in keys]

    def delete_many(self, keys: Sequence[bytes]) -> int:
        n = 0
        with self._lock:
            for k in keys:
                slot = self._blocks.pop(k, None)
                self._sums.pop(k, None)
                if slot is not None:
                    self._used -= slot.nbytes
                    pin = self._pins.get(k)
                    if pin is None or pin[1] is not slot:   # a pinned slot is freed by unpin_slots
                        self._release(slot)
                    n += 1
        return n

    def clear(self, namespace: bytes | None = None) -> int:
        with self._lock:
            keys = [k for k in self._blocks if namespace is None or k.startswith(namespace)]
        return self.delete_many(keys)

    def register_namespace(self, ns: Namespace) -> None:
        self.namespaces[ns.digest()] = ns.describe()

    def stats(self) -> StoreStats:
        with self._lock:
            s = StoreStats(**vars(self._stats))
            s.blocks, s.bytes_used = len(self._blocks), self._used
            s.extra = {**self._stats.extra, "recycled_slots": self._recycled,
                       "spare_bytes": self._held_bytes()}
            return s

    def tier_stats(self) -> dict[str, StoreStats]:
        return {"local": self.stats()}

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
