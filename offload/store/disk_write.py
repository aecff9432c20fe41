"""DiskStore's write path, mixed into `DiskStore`: put, the group committer's transaction, flush.

`put_many` skips keys stored or in flight, reserves slots (one unsynced transaction, under the
writer connection's deadline: `index_access.py`), writes the blocks (`coalesce.write_batch`, no
fdatasync) and hands them to the `Committer` (`commit.py`), whose rounds call `_commit` (one synced
transaction for every block synced since the last round) and `_committed`. A failed commit frees
its slots at once, or, when the index cannot be written either, in this process's next
reservation (`_orphans`). `flush` and `durable` wait for the committer.
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
from offload.store import coalesce, slab, slot_format
from offload.store.base import Buffer, StoreStats, never_raises, total_len
from offload.store.commit import BUSY as COMMIT_BUSY
from offload.store.commit import Batch, Committer
from offload.store.index import Allocation, Freed, Index, Location
from offload.store.index_access import BUSY, DATA_LOCK_TIMEOUT_S, IndexAccess

log = logging.getLogger("offload.store.disk")

DURABLE_WAIT_S = 5.0        # `durable` (a server about to acknowledge a put) waits this long


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

    def _refresh_keys(self) -> bool:
        raise NotImplementedError

    def _drop_missing(self, index: Index) -> None:
        raise NotImplementedError

    def _free_slot(self, f: Freed) -> None:
        raise NotImplementedError

    @never_raises("disk put", _skipped)
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]) -> list[bool]:
        """Write the blocks; True once written (visible once durable: see `disk.py`)."""
        if len(keys) != len(blocks):
            log.error("put: %d keys but %d blocks; nothing stored", len(keys), len(blocks))
            return [False] * len(keys)
        result = [False] * len(keys)
        items: list[tuple[bytes, int, int, int]] = []
        where: dict[bytes, list[int]] = {}
        bufs_of: dict[bytes, Sequence[Buffer]] = {}
        with self._lock:
            if not self._refresh_keys():
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
        if not self._commits.room(sum(n for _, n, _, _ in items), DATA_LOCK_TIMEOUT_S):
            log.warning("put: %d blocks skipped: the index commits fall behind", len(items))
            self._stats.put_skipped += len(items)
            return result
        alloc = self._ix.write(self._allocate(items))
        if alloc is BUSY:
            log.warning("put: %d blocks skipped: the index is busy", len(items))
            self._stats.put_skipped += len(items)
            return result
        assert isinstance(alloc, Allocation)
        for k in alloc.present:
            for i in where[k]:
                result[i] = True
        for k, why in alloc.skipped.items():
            log.warning("block %s not stored: %s", k.hex()[:16], why)
            self._stats.put_skipped += 1
        outcomes = coalesce.write_batch(self._slabs, self._pool, alloc.new,
                                        [bufs_of[loc.key] for loc in alloc.new], time.time_ns(),
                                        self.cfg.io_threads, sync=False)
        batch = Batch([], [])
        for loc, (err, csum) in zip(alloc.new, outcomes):
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

    def _allocate(self, items: list[tuple[bytes, int, int, int]]) -> Callable[[Index], Allocation]:
        """Reserve slots (under the write lock; the key set refreshed)."""
        def run(index: Index) -> Allocation:
            alloc = index.allocate(
                items, self._owner, high=self.cfg.high_watermark, low=self.cfg.low_watermark,
                free_bytes=lambda: self._free_bytes(self.directory), min_free=self.cfg.min_free,
                segment_size=self.cfg.segment_size, create_segment=self._slabs.create,
                free_slot=self._free_slot, release=self._orphans)
            self._orphans = []
            self._stats.evictions += alloc.evicted
            self._drop_missing(index)
            return alloc
        return run

    def _commit(self, good: list[tuple[Location, int]], free: list[Location]) -> str:
        """The committer's transaction: '' done, COMMIT_BUSY (retried), else why it failed (the
        slots are then freed, now or by the next reservation)."""
        def run(index: Index) -> None:
            index.finish([(loc.key, c) for loc, c in good], free, [], self._free_slot)
            self._drop_missing(index)

        try:
            if self._ix.write(run) is BUSY:
                return COMMIT_BUSY
            return ""
        except (sqlite3.Error, OSError) as e:
            why = f"index commit failed: {e}"
        mine = [loc for loc, _ in good] + free
        try:
            if self._ix.write(lambda index: index.release(mine, self._free_slot)) is not BUSY:
                return why
        except (sqlite3.Error, OSError) as e:
            log.warning("%d pending slots not released yet (%s): the next put frees them",
                        len(mine), e)
        with self._ix.wlock:
            self._orphans += mine
        return why

    def _committed(self, done: list[Location], lost: list[Location], why: str) -> None:
        with self._lock:
            self._keys.update(loc.key for loc in done)
            self._stats.puts += len(done)
            self._stats.bytes_written += sum(loc.length for loc in done)
            self._stats.put_skipped += len(lost)
        if lost:
            log.error("%d blocks written but never made visible (%s): they are not stored",
                      len(lost), why)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block put so far is durable and visible (or failed, counted). True if
        all are; False if `timeout` passed first or a block was lost since the last flush."""
        return self._commits.flush(timeout)

    @never_raises("disk durable", _absent)
    def durable(self, keys: Sequence[bytes]) -> list[bool]:
        """Wait until this process's puts of `keys` are committed or lost: per key, whether it is
        stored durably now (what a server acknowledges to its client: `base.durable`)."""
        self._commits.wait_for(keys, DURABLE_WAIT_S)
        with self._lock:
            if not self._refresh_keys():
                return [False] * len(keys)
            return [k in self._keys for k in keys]


__all__ = ["DiskWrites"]
