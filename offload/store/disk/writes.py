"""A disk store's write side: put, delete, flush / durable, and the slots a close gives back.

`Writes(state, commits)`: `put_many` skips keys stored or in flight, takes slots from this process's
reserved range (`spare.py`; one unsynced reservation transaction when it runs out, under the writer
connection's deadline: `disk/index/access.py`), writes the blocks (`coalesce.write_batch`, no
fdatasync) and hands them to the `Committer` (`commit.py`), whose rounds make them visible
(`finish.py`). `delete_many` (blocks in flight too), `flush` and `durable` (wait for the
committer), `give_back` (on close: the range and the written slots of failed commits back to the
index). The face (`store.py`) guards the public calls (`never_raises`).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from typing import Callable, Sequence

from offload.keys import KEY_BYTES
from offload.store.base import Buffer, StoreStats, total_len
from offload.store.disk.commit import Batch, Committer
from offload.store.disk.index.access import BUSY, DATA_LOCK_TIMEOUT_S, Busy
from offload.store.disk.index.db import Index, Location
from offload.store.disk.index.schema import Reserved
from offload.store.disk.reads import INFLIGHT_WAIT_S
from offload.store.disk.slab import coalesce
from offload.store.disk.slab import format as slot_format
from offload.store.disk.spare import RANGE_BYTES, RANGE_SHARE
from offload.store.disk.state import DiskState

log = logging.getLogger("offload.store.disk.store")

DURABLE_WAIT_S = 5.0        # `durable` (a server about to acknowledge a put) waits this long
# A put runs on a writer's own thread (SGLang's backup thread, the agent's store writer), never
# on a request's: it waits this long for the index lock and the committer before it skips its
# blocks, so a slow log sync on a loaded disk delays a write-back instead of losing it.
PUT_WAIT_S = 2.0
PUT_STALE_S = 0.25          # a put trusts its key set this long (see put_many)


def skipped(stats: StoreStats, keys: Sequence[bytes]) -> list[bool]:
    """A put that stored nothing: counted, one False per key."""
    stats.put_skipped += len(keys)
    return [False] * len(keys)


class Writes:
    def __init__(self, state: DiskState, commits: Committer):
        self.state, self.commits = state, commits
        self._held_checked = time.monotonic()   # the last check of the range against the index

    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]],
                 wait_s: float = PUT_WAIT_S) -> list[bool]:
        """Write the blocks; True once written (visible once durable: see `store.py`). `wait_s`:
        how long it may wait for the index and the committer (a put on a read's path, such as a
        promotion from a shared tier, passes the read path's `DATA_LOCK_TIMEOUT_S`).

        The per-call bookkeeping stays off the device's path: the key set is refreshed (a read of
        other processes' commits) only when it is over `PUT_STALE_S` old or the index was rebuilt
        — a key another process stored meanwhile is written again and its commit keeps one copy
        (`Index.commit_reserved`); a key it deleted meanwhile is skipped as stored (a later miss,
        never a wrong block)."""
        st = self.state
        if len(keys) != len(blocks):
            log.error("put: %d keys but %d blocks; nothing stored", len(keys), len(blocks))
            return [False] * len(keys)
        end = time.monotonic() + wait_s   # for the waits on the index and the committer
        result = [False] * len(keys)
        items: list[tuple[bytes, int, int, int]] = []
        where: dict[bytes, list[int]] = {}
        bufs_of: dict[bytes, Sequence[Buffer]] = {}
        with st.lock:
            if not self._fresh_enough():
                return skipped(st.stats, keys)
            for i, (k, bufs) in enumerate(zip(keys, blocks)):
                if len(k) != KEY_BYTES:
                    log.error("put: key of %d bytes (want %d) skipped", len(k), KEY_BYTES)
                    continue
                if k in st.keys or self.commits.in_flight(k):
                    result[i] = True
                    continue
                if k not in where:
                    n = total_len(bufs)
                    items.append((k, n, slot_format.slot_bytes_for(n), 0))
                    bufs_of[k] = bufs
                where.setdefault(k, []).append(i)
        if not items:
            return result
        if not self.commits.room(sum(n for _, n, _, _ in items), end - time.monotonic()):
            log.warning("put: %d blocks skipped: the index commits fall behind", len(items))
            st.stats.put_skipped += len(items)
            return result
        new = self._slots_for(items, end)
        if new is None:
            log.warning("put: %d blocks skipped: the index is busy", len(items))
            st.stats.put_skipped += len(items)
            return result
        outcomes = coalesce.write_batch(st.slabs, st.pool, new,
                                        [bufs_of[loc.key] for loc in new], time.time_ns(),
                                        st.cfg.io_threads, sync=False)
        batch = Batch([], [])
        for loc, (written, csum) in zip(new, outcomes):
            if not written.ok:
                log.warning("block %s not stored: %s", loc.key.hex()[:16], written.reason)
                st.stats.put_skipped += 1
                batch.failed.append(loc)
            else:
                batch.locs.append(loc)
                batch.csums.append(csum)
                batch.nbytes += loc.length
                for i in where[loc.key]:
                    result[i] = True
        if batch.locs or batch.failed:
            self.commits.submit(batch)
        return result

    def _fresh_enough(self) -> bool:
        """The key set, refreshed if over `PUT_STALE_S` old or the index was rebuilt (caller holds
        the state lock). False if the index stayed busy."""
        st = self.state
        if time.monotonic() - st.refreshed < PUT_STALE_S and not st.ix.replaced():
            return True
        return st.refresh_keys()

    def _slots_for(self, items: list[tuple[bytes, int, int, int]],
                   end: float) -> list[Location] | None:
        """Slots for (key, length, slot_bytes, _) items: from this process's reserved range, with
        one reservation transaction only when the range runs out (None: the index is busy; a
        block with no room is skipped, counted). Short of room while blocks of this process are
        in flight, it waits for their round (until `end`, monotonic) and reserves once more."""
        st = self.state
        want: dict[int, int] = {}
        for _, _, sb, _ in items:
            want[sb] = want.get(sb, 0) + 1
        with st.lock:
            got = {sb: st.spare.take(sb, n) for sb, n in want.items()}
            self._check_range(got)
        why: dict[int, str] = {}
        for attempt in (1, 2):
            short = {sb: n - len(got[sb]) for sb, n in want.items() if len(got[sb]) < n}
            if not short:
                break
            if attempt == 2:   # no room: blocks in flight become evictable once committed
                left = end - time.monotonic()
                if left <= 0 or not self.commits.pending() or not self.commits.settle(left):
                    break
            res = self._reserve_into(got, short, end)
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
                st.stats.put_skipped += 1
        return new

    def _reserve_into(self, got: dict[int, list[tuple[int, int]]],
                      short: dict[int, int], end: float) -> Reserved | None:
        """One reservation transaction: `short` more slots per size into `got`, plus a range
        ahead into the spare, sized to what this process writes (`Spare.ask_ahead`); sizes
        unused for a while go back, and the rest of the range too if the need would evict
        (None: the index is busy; `got` and the range then stay this process's)."""
        st = self.state
        limit = max(0, min(RANGE_BYTES, st.cfg.capacity // RANGE_SHARE,
                           st.cfg.segment_size))   # ahead: at most one new slab file
        with st.lock:
            wants = {sb: (n, st.spare.ask_ahead(sb, n, limit // sb)) for sb, n in short.items()}
            unused = st.spare.take_idle()
            offer = st.spare.clear()
        res: object = BUSY
        try:
            res = st.ix.write(self._reserve(wants, unused, offer),
                              wait=max(DATA_LOCK_TIMEOUT_S, end - time.monotonic()))
        finally:
            if res is BUSY:   # busy or failed: the slots taken stay this process's
                with st.lock:
                    st.spare.add(got)
                    st.spare.put_back(unused + offer)
        if res is BUSY:
            return None
        assert isinstance(res, Reserved)
        with st.lock:
            if not res.offer_taken:
                st.spare.put_back(offer)
            for sb, n in short.items():
                slots = res.slots.get(sb, [])
                got[sb] += slots[:n]
                st.spare.add({sb: slots[n:]})
        return res

    def _check_range(self, got: dict[int, list[tuple[int, int]]]) -> None:
        """Drop range slots that were taken back (caller holds the state lock). What takes a
        live process's reserved slots: another process rebuilding the index (noticed by
        `_fresh_enough` on every put, which clears the range), another process dropping a
        segment whose slab file it found deleted (checked here on every put, a `fstat` per
        segment), and a reclaim that took this process for dead (a misconfiguration: checked
        here against the index every `PUT_STALE_S`, and again by the commit, so such a block is
        lost, never made visible)."""
        st = self.state
        for sb, slots in got.items():
            for seg in {seg for seg, _ in slots}:
                if st.slabs.fds.gone(seg, sb):
                    st.spare.drop_segment(seg)
                    got[sb] = [s for s in got[sb] if s[0] != seg]
        if time.monotonic() - self._held_checked >= PUT_STALE_S:
            self._still_held(got)

    def _still_held(self, got: dict[int, list[tuple[int, int]]]) -> None:
        """Keep only range slots whose reservation the index still holds (one read, never
        waiting on a writer): a slab dropped or an index rebuilt by another process takes them
        back. Caller holds the state lock. (The commit checks again: a slot taken back between
        here and there is a lost block, never a wrong one.)"""
        st = self.state
        self._held_checked = time.monotonic()
        try:
            for sb, slots in got.items():
                if slots:
                    held = st.ix.reader.held(st.owner, sb, slots)
                    if len(held) < len(slots):
                        for seg in {seg for seg, slot in slots if (seg, slot) not in held}:
                            st.spare.drop_segment(seg)
                        got[sb] = [s for s in slots if s in held]
        except sqlite3.Error as e:
            log.debug("reserved range not checked (%s): the commit checks it", e)

    def _reserve(self, wants: dict[int, tuple[int, int]], unused: list[tuple[int, int, int]],
                 offer: list[tuple[int, int, int]]) -> Callable[[Index], Reserved]:
        """Reserve a range of slots for this process (under the write lock)."""
        st = self.state
        def run(index: Index) -> Reserved:
            st.drop_missing(index)   # first: no slot of a lost slab handed out again
            res = index.reserve(
                wants, st.owner, high=st.cfg.high_watermark, low=st.cfg.low_watermark,
                free_bytes=lambda: st.free_bytes(st.directory), min_free=st.cfg.min_free,
                segment_size=st.cfg.segment_size, create_segment=st.slabs.create,
                free_slot=st.free_slot, release=st.orphans, give_back=st.written_back,
                unused=unused, offer=offer)
            st.orphans, st.written_back = [], []
            st.evicted(res.evicted)
            st.drop_missing(index)   # (one found missing meanwhile, by an eviction's punch)
            return res
        return run

    def commit_now(self) -> None:
        """Start the group committer's next round now (a server about to wait for blocks that a
        background confirmer waits for without hurrying)."""
        self.commits.kick()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block put so far is durable and visible (or failed, counted). True if
        all are; False if `timeout` passed first or a block was lost since the last flush."""
        return self.commits.flush(timeout)

    def durable(self, keys: Sequence[bytes], hurry: bool = True) -> list[bool]:
        """Wait until this process's puts of `keys` are committed or lost: per key, whether it is
        stored durably now (what a server acknowledges to its client: `base.durable`). `hurry`:
        start their commit round now; a background confirmer passes False and lets rounds group."""
        st = self.state
        self.commits.wait_for(keys, DURABLE_WAIT_S, hurry)
        with st.lock:
            if not st.refresh_keys():
                return [False] * len(keys)
            return [k in st.keys for k in keys]

    def delete_many(self, keys: Sequence[bytes]) -> int:
        st = self.state
        flying = [k for k in keys if self.commits.in_flight(k)]
        if flying:   # not made visible after all, or deleted once it is
            self.commits.cancel(flying)
            self.commits.wait_for(flying, INFLIGHT_WAIT_S)
        n = st.ix.write(lambda index: index.delete(list(keys), st.free_slot))
        dropped = self.commits.honored(flying) if flying else 0
        if isinstance(n, Busy):
            log.warning("delete: the index is busy; %d blocks not deleted", len(keys))
            return dropped
        with st.lock:
            st.keys.difference_update(keys)
        return n + dropped

    def give_back(self, index: Index) -> None:
        """This process's reserved slots back to the index (under the write lock)."""
        st = self.state
        with st.lock:
            spare = st.spare.clear()
        index.return_reserved(spare, st.owner, st.free_slot, punch=False)
        written, st.written_back = st.written_back, []
        index.return_reserved([(loc.slot_bytes, loc.seg, loc.slot) for loc in written],
                              st.owner, st.free_slot, punch=True)


__all__ = ["DURABLE_WAIT_S", "PUT_STALE_S", "PUT_WAIT_S", "Writes", "skipped"]
