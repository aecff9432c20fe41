"""DiskStore's write path, mixed into `DiskStore`: put, the group committer's transaction, flush.

`put_many` skips keys stored or in flight, reserves slots (one unsynced transaction, under the
writer connection's deadline: `disk/index/access.py`), writes the blocks (`coalesce.write_batch`, no
fdatasync) and hands them to the `Committer` (`commit.py`), whose rounds call `_commit_reserved`
(one synced transaction for every block synced since the last round) and `_committed`. A failed
commit frees its slots at once, or, when the index cannot be written either, in this process's
next index transaction (`_give_up`). `flush` and `durable` wait for the committer.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from concurrent.futures import Executor
from typing import Any, Callable, Sequence

from offload.config import StoreConfig
from offload.keys import KEY_BYTES
from offload.store.base import Buffer, StoreStats, never_raises, total_len
from offload.store.disk.commit import BUSY as COMMIT_BUSY
from offload.store.disk.commit import Batch, Committer
from offload.store.disk.index.access import BUSY, DATA_LOCK_TIMEOUT_S, IndexAccess, IndexReplaced
from offload.store.disk.index.db import Allocation, Freed, Index, Location
from offload.store.disk.index.schema import Reserved
from offload.store.disk.slab import coalesce
from offload.store.disk.slab import files as slab
from offload.store.disk.slab import format as slot_format
from offload.store.disk.spare import RANGE_BYTES, RANGE_SHARE, Spare

log = logging.getLogger("offload.store.disk.store")

DURABLE_WAIT_S = 5.0        # `durable` (a server about to acknowledge a put) waits this long
PUT_STALE_S = 0.25          # a put trusts its key set this long (see put_many)


def _skipped(self: "DiskWrites", keys: Sequence[bytes], *_: Any) -> list[bool]:
    self._stats.put_skipped += len(keys)
    return [False] * len(keys)


def _absent(_self: "DiskWrites", keys: Sequence[bytes]) -> list[bool]:
    return [False] * len(keys)


class DiskWrites:
    # provided by DiskStore
    cfg: StoreConfig
    directory: str
    _free_bytes: Callable[[str], int]
    _slabs: slab.SlabFiles
    _pool: Executor
    _stats: StoreStats
    _lock: threading.RLock
    _keys: set[bytes]
    _ix: IndexAccess
    _commits: Committer
    _orphans: list[Location]
    _owner: str
    _spare: Spare                        # this process's reserved, never written slots
    _written_back: list[Location]        # written reserved slots to give back (under wlock)
    _not_ours: set[tuple[int, int]]      # (seg, slot) whose commit found the slot taken back
    _refreshed: float                    # monotonic time of the last key-set refresh
    _held_checked: float                 # ... of the last check of the range against the index

    def _refresh_keys(self) -> bool:
        raise NotImplementedError

    def _drop_missing(self, index: Index) -> None:
        raise NotImplementedError

    def _free_slot(self, f: Freed) -> None:
        raise NotImplementedError

    @never_raises("disk put", _skipped)
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]) -> list[bool]:
        """Write the blocks; True once written (visible once durable: see `disk.py`).

        The per-call bookkeeping stays off the device's path: the key set is refreshed (a read of
        other processes' commits) only when it is over `PUT_STALE_S` old or the index was rebuilt
        — a key another process stored meanwhile is written again and its commit keeps one copy
        (`Index.commit_reserved`); a key it deleted meanwhile is skipped as stored (a later miss,
        never a wrong block)."""
        if len(keys) != len(blocks):
            log.error("put: %d keys but %d blocks; nothing stored", len(keys), len(blocks))
            return [False] * len(keys)
        end = time.monotonic() + DATA_LOCK_TIMEOUT_S   # for the waits on the committer
        result = [False] * len(keys)
        items: list[tuple[bytes, int, int, int]] = []
        where: dict[bytes, list[int]] = {}
        bufs_of: dict[bytes, Sequence[Buffer]] = {}
        with self._lock:
            if not self._fresh_enough():
                return _skipped(self, keys)
            for i, (k, bufs) in enumerate(zip(keys, blocks)):
                if len(k) != KEY_BYTES:
                    log.error("put: key of %d bytes (want %d) skipped", len(k), KEY_BYTES)
                    continue
                if k in self._keys or self._commits.in_flight(k):
                    result[i] = True
                    continue
                if k not in where:
                    n = total_len(bufs)
                    items.append((k, n, slot_format.slot_bytes_for(n), 0))
                    bufs_of[k] = bufs
                where.setdefault(k, []).append(i)
        if not items:
            return result
        if not self._commits.room(sum(n for _, n, _, _ in items), end - time.monotonic()):
            log.warning("put: %d blocks skipped: the index commits fall behind", len(items))
            self._stats.put_skipped += len(items)
            return result
        new = self._slots_for(items, end)
        if new is None:
            log.warning("put: %d blocks skipped: the index is busy", len(items))
            self._stats.put_skipped += len(items)
            return result
        outcomes = coalesce.write_batch(self._slabs, self._pool, new,
                                        [bufs_of[loc.key] for loc in new], time.time_ns(),
                                        self.cfg.io_threads, sync=False)
        batch = Batch([], [])
        for loc, (err, csum) in zip(new, outcomes):
            if err:
                log.warning("block %s not stored: %s", loc.key.hex()[:16], err)
                self._stats.put_skipped += 1
                batch.failed.append(loc)
            else:
                batch.locs.append(loc)
                batch.csums.append(csum)
                batch.nbytes += loc.length
                for i in where[loc.key]:
                    result[i] = True
        if batch.locs or batch.failed:
            self._commits.submit(batch)
        return result

    def _fresh_enough(self) -> bool:
        """The key set, refreshed if over `PUT_STALE_S` old or the index was rebuilt (caller holds
        the state lock). False if the index stayed busy."""
        if time.monotonic() - self._refreshed < PUT_STALE_S and not self._ix.replaced():
            return True
        return self._refresh_keys()

    def _slots_for(self, items: list[tuple[bytes, int, int, int]],
                   end: float) -> list[Location] | None:
        """Slots for (key, length, slot_bytes, _) items: from this process's reserved range, with
        one reservation transaction only when the range runs out (None: the index is busy; a
        block with no room is skipped, counted). Short of room while blocks of this process are
        in flight, it waits for their round (until `end`, monotonic) and reserves once more."""
        want: dict[int, int] = {}
        for _, _, sb, _ in items:
            want[sb] = want.get(sb, 0) + 1
        with self._lock:
            got = {sb: self._spare.take(sb, n) for sb, n in want.items()}
            self._check_range(got)
        why: dict[int, str] = {}
        for attempt in (1, 2):
            short = {sb: n - len(got[sb]) for sb, n in want.items() if len(got[sb]) < n}
            if not short:
                break
            if attempt == 2:   # no room: blocks in flight become evictable once committed
                left = end - time.monotonic()
                if left <= 0 or not self._commits.pending() or not self._commits.settle(left):
                    break
            res = self._reserve_into(got, short)
            if res is None:
                return None
            why = res.short
        new = []
        for k, length, sb, _ in items:
            if got[sb]:
                seg, slot = got[sb].pop(0)
                new.append(Location(k, seg, slot, sb, length, 0))
            else:
                log.warning("block %s not stored: %s", k.hex()[:16], why.get(sb, "no slot"))
                self._stats.put_skipped += 1
        return new

    def _reserve_into(self, got: dict[int, list[tuple[int, int]]],
                      short: dict[int, int]) -> Reserved | None:
        """One reservation transaction: `short` more slots per size into `got`, plus a range
        ahead into the spare, sized to what this process writes (`Spare.ask_ahead`); sizes
        unused for a while go back, and the rest of the range too if the need would evict
        (None: the index is busy; `got` and the range then stay this process's)."""
        limit = max(0, min(RANGE_BYTES, self.cfg.capacity // RANGE_SHARE,
                           self.cfg.segment_size))   # ahead: at most one new slab file
        with self._lock:
            wants = {sb: (n, self._spare.ask_ahead(sb, n, limit // sb)) for sb, n in short.items()}
            unused = self._spare.take_idle()
            offer = self._spare.clear()
        res: object = BUSY
        try:
            res = self._ix.write(self._reserve(wants, unused, offer))
        finally:
            if res is BUSY:   # busy or failed: the slots taken stay this process's
                with self._lock:
                    self._spare.add(got)
                    self._spare.put_back(unused + offer)
        if res is BUSY:
            return None
        assert isinstance(res, Reserved)
        with self._lock:
            if not res.offer_taken:
                self._spare.put_back(offer)
            for sb, n in short.items():
                slots = res.slots.get(sb, [])
                got[sb] += slots[:n]
                self._spare.add({sb: slots[n:]})
        return res

    def _check_range(self, got: dict[int, list[tuple[int, int]]]) -> None:
        """Drop range slots that were taken back (caller holds the state lock). What takes a
        live process's reserved slots: another process rebuilding the index (noticed by
        `_fresh_enough` on every put, which clears the range), another process dropping a
        segment whose slab file it found deleted (checked here on every put, a `fstat` per
        segment), and a reclaim that took this process for dead (a misconfiguration: checked
        here against the index every `PUT_STALE_S`, and again by the commit, so such a block is
        lost, never made visible)."""
        for sb, slots in got.items():
            for seg in {seg for seg, _ in slots}:
                if self._slabs.fds.gone(seg, sb):
                    self._spare.drop_segment(seg)
                    got[sb] = [s for s in got[sb] if s[0] != seg]
        if time.monotonic() - self._held_checked >= PUT_STALE_S:
            self._still_held(got)

    def _still_held(self, got: dict[int, list[tuple[int, int]]]) -> None:
        """Keep only range slots whose reservation the index still holds (one read, never
        waiting on a writer): a slab dropped or an index rebuilt by another process takes them
        back. Caller holds the state lock. (The commit checks again: a slot taken back between
        here and there is a lost block, never a wrong one.)"""
        self._held_checked = time.monotonic()
        try:
            for sb, slots in got.items():
                if slots:
                    held = self._ix.reader.held(self._owner, sb, slots)
                    if len(held) < len(slots):
                        for seg in {seg for seg, slot in slots if (seg, slot) not in held}:
                            self._spare.drop_segment(seg)
                        got[sb] = [s for s in slots if s in held]
        except sqlite3.Error as e:
            log.debug("reserved range not checked (%s): the commit checks it", e)

    def _reserve(self, wants: dict[int, tuple[int, int]], unused: list[tuple[int, int, int]],
                 offer: list[tuple[int, int, int]]) -> Callable[[Index], Reserved]:
        """Reserve a range of slots for this process (under the write lock)."""
        def run(index: Index) -> Reserved:
            self._drop_missing(index)   # first: no slot of a lost slab handed out again
            res = index.reserve(
                wants, self._owner, high=self.cfg.high_watermark, low=self.cfg.low_watermark,
                free_bytes=lambda: self._free_bytes(self.directory), min_free=self.cfg.min_free,
                segment_size=self.cfg.segment_size, create_segment=self._slabs.create,
                free_slot=self._free_slot, release=self._orphans, give_back=self._written_back,
                unused=unused, offer=offer)
            self._orphans, self._written_back = [], []
            self._evicted(res.evicted)
            self._drop_missing(index)   # (one found missing meanwhile, by an eviction's punch)
            return res
        return run

    def _evicted(self, n: int) -> None:
        """Blocks this process just evicted: counted, and the next put reads the change log (its
        key set names them until then)."""
        if n:
            self._stats.evictions += n
            self._refreshed = float("-inf")

    def _allocate(self, items: list[tuple[bytes, int, int, int]]) -> Callable[[Index], Allocation]:
        """Reserve slots (under the write lock; the key set refreshed)."""
        def run(index: Index) -> Allocation:
            self._drop_missing(index)
            alloc = index.allocate(
                items, self._owner, high=self.cfg.high_watermark, low=self.cfg.low_watermark,
                free_bytes=lambda: self._free_bytes(self.directory), min_free=self.cfg.min_free,
                segment_size=self.cfg.segment_size, create_segment=self._slabs.create,
                free_slot=self._free_slot, release=self._orphans)
            self._orphans = []
            self._evicted(alloc.evicted)
            self._drop_missing(index)
            return alloc
        return run

    def _commit(self, good: list[tuple[Location, int]], free: list[Location]) -> str:
        """The slot path's commit (`SlotAccess`: slots written by another path, e.g. GDS): ''
        done, COMMIT_BUSY, else why it failed (`_give_up`: the pending slots freed)."""
        def run(index: Index) -> None:
            index.finish([(loc.key, c) for loc, c in good], free, [], self._free_slot)
            self._drop_missing(index)

        try:
            return COMMIT_BUSY if self._ix.write(run) is BUSY else ""
        except IndexReplaced as e:
            return f"not committed: {e}"
        except (sqlite3.Error, OSError) as e:
            mine = [loc for loc, _ in good] + free
            return self._give_up(f"index commit failed: {e}", mine,
                                 lambda index: index.release(mine, self._free_slot),
                                 lambda: self._orphans.extend(mine))

    def _commit_reserved(self, good: list[tuple[Location, int]], free: list[Location]) -> str:
        """The committer's transaction for put slots (from the reserved range): '' done,
        COMMIT_BUSY (retried), else why it failed (`_give_up`: the slots given back). A slot no
        longer this process's is lost (see `_committed`)."""
        def run(index: Index) -> list[Location]:   # slots of an earlier failure go back too
            lost = index.commit_reserved(good, free + self._written_back, self._owner,
                                         self._free_slot)
            self._written_back = []
            self._drop_missing(index)
            return lost

        try:
            lost = self._ix.write(run)
        except IndexReplaced as e:   # the slots are not ours in the new index: lost, counted
            return f"not committed: {e}"
        except (sqlite3.Error, OSError) as e:
            mine = [loc for loc, _ in good] + free
            slots = [(loc.slot_bytes, loc.seg, loc.slot) for loc in mine]
            return self._give_up(f"index commit failed: {e}", mine,
                                 lambda index: index.return_reserved(
                                     slots, self._owner, self._free_slot, punch=True),
                                 lambda: self._written_back.extend(mine))
        if lost is BUSY:
            return COMMIT_BUSY
        assert isinstance(lost, list)
        self._not_ours.update((loc.seg, loc.slot) for loc in lost)
        return ""

    def _give_up(self, why: str, mine: list[Location], release: Callable[[Index], object],
                 later: Callable[[], None]) -> str:
        """A failed commit's slots: freed now by `release` (a transaction of their own), else by
        this process's next index transaction (`later`, under the write lock). Returns `why`."""
        try:
            if self._ix.write(release) is not BUSY:
                return why
        except (sqlite3.Error, OSError) as e:
            log.warning("%d slots of a failed commit not freed yet (%s): the next index "
                        "transaction frees them", len(mine), e)
        with self._ix.wlock:
            later()
        return why

    def _committed(self, done: list[Location], lost: list[Location], why: str) -> list[Location]:
        """A round's outcome into the key set and the counters; returns the blocks of `done`
        that were not stored after all (their slot was taken back), for the committer's
        `flush` to say so."""
        gone: list[Location] = []
        if self._not_ours:   # their slots were taken back (a rebuild, a reclaim): not stored
            gone = [loc for loc in done if (loc.seg, loc.slot) in self._not_ours]
            self._not_ours.difference_update((loc.seg, loc.slot) for loc in gone)
            done = [loc for loc in done if loc not in gone]
            lost = lost + gone
            why = why or "its slot was no longer this process's"
        with self._lock:
            self._keys.update(loc.key for loc in done)
            self._stats.puts += len(done)
            self._stats.bytes_written += sum(loc.length for loc in done)
            self._stats.put_skipped += len(lost)
        if lost:
            log.error("%d blocks written but never made visible (%s): they are not stored",
                      len(lost), why)
        return gone

    def commit_now(self) -> None:
        """Start the group committer's next round now (a server about to wait for blocks that a
        background confirmer waits for without hurrying)."""
        self._commits.kick()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block put so far is durable and visible (or failed, counted). True if
        all are; False if `timeout` passed first or a block was lost since the last flush."""
        return self._commits.flush(timeout)

    @never_raises("disk durable", _absent)
    def durable(self, keys: Sequence[bytes], hurry: bool = True) -> list[bool]:
        """Wait until this process's puts of `keys` are committed or lost: per key, whether it is
        stored durably now (what a server acknowledges to its client: `base.durable`). `hurry`:
        start their commit round now; a background confirmer passes False and lets rounds group."""
        self._commits.wait_for(keys, DURABLE_WAIT_S, hurry)
        with self._lock:
            if not self._refresh_keys():
                return [False] * len(keys)
            return [k in self._keys for k in keys]


__all__ = ["DiskWrites"]
