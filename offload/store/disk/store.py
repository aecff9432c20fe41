"""The NVMe block store: slab files + a crash-safe SQLite index + a checksum on every block.

`DiskStore(StoreConfig)` opens (or creates) one cache directory. Any number of processes may open the
same directory at once (tensor-parallel ranks, replicas on one node): the index serialises the
bookkeeping, slots are owned by exactly one block, and the capacity cap lives in the index, so it
holds for all of them together.

Put: skip keys already stored or in flight -> reserve slots in one unsynced transaction (evicting
least-recently-used blocks past the high watermark, down to the low one; skipping blocks when the
cap or the file system is full) -> this thread checksums each run of blocks while the I/O threads
write the run before it (header + data, O_DIRECT, vectored) -> `put_many` returns (the caller's
buffers are free again; `disk/writes.py`).
The group committer (`commit.py`) then fdatasyncs every touched slab and makes all the blocks
written since its last round visible in one synced transaction: other processes, and a restart
after a crash, see a block only once it is durable. This process counts its blocks in flight as stored (exists
says yes, a put skips them) and a get of one waits for its commit (then reads it as any other).
`flush()` waits for all; `close()` flushes. A crash at any point leaves at most pending slots of a
dead process, reclaimed on the next open or under pressure; a failed commit frees its slots (or
the next reservation does, if the index could not be written then).
Get: locate in the index -> the I/O threads read header + data straight into the caller's buffers ->
the header must match the index and the data its checksum, else the block is deleted and it is a miss.
Open (`recovery.open_index`): the directory is checked or created 0700 (`cachedir.prepare`: owned by
the service user, writable by nobody else); under the lock file, taken with a deadline,
`PRAGMA quick_check` (an index another process keeps locked is waited for, never damage); a
damaged index is set aside (`index.db.damaged-<time>`) and rebuilt from the slab headers, unless
another process has the directory open (then a `StoreError`); segments whose slab file is missing
are dropped; this process's lease is taken (`owner.py`: the kernel's OFD lock says who is alive);
dead processes' slots are reclaimed.
A slab found missing later (a read, a write, a sync) is dropped the same way.

The data path (put/get/exists/delete) never raises (`never_raises`): it returns per-block flags and
logs why. It never waits on the index longer than `DATA_LOCK_TIMEOUT_S` (`disk/index/access.py`: reads
and writes go through separate connections, so gets go on while a write waits); past that a read
is a miss and a write is skipped, counted in `stats().index_busy`; an index row that fails the
range checks is a miss for that block and dropped, counted in `stats().damaged_rows`.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from offload.config import StoreConfig
from offload.errors import StoreError
from offload.store.base import Buffer, StoreStats, never_raises, total_len
from offload.store.disk import cachedir
from offload.store.disk.admin import DiskAdmin
from offload.store.disk.commit import Committer
from offload.store.disk.index.access import BUSY, DATA_LOCK_TIMEOUT_S, LOCK_TIMEOUT_S, IndexAccess
from offload.store.disk.index.db import Freed, Index, Location
from offload.store.disk.owner import Lease
from offload.store.disk.recovery import open_index
from offload.store.disk.slab import coalesce, fdcache
from offload.store.disk.slab import files as slab
from offload.store.disk.slots import SlotAccess
from offload.store.disk.spare import Spare
from offload.store.disk.writes import DiskWrites

log = logging.getLogger(__name__)

TOUCH_FLUSH_S = 1.0
PENDING_BYTES = 256 << 20   # written but not yet visible (the group committer's bound)
INFLIGHT_WAIT_S = 1.0       # a get of a block this process put waits this long for its commit


def _missed(self: "DiskStore", keys: Sequence[bytes], *_: Any) -> list[bool]:
    self._stats.misses += len(keys)
    return [False] * len(keys)


def _nothing(*_: Any) -> int:
    return 0


def _absent(_self: "DiskStore", keys: Sequence[bytes]) -> list[bool]:
    return [False] * len(keys)


def fs_free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class DiskStore(DiskWrites, SlotAccess, DiskAdmin):
    def __init__(self, cfg: StoreConfig, *, free_bytes: Callable[[str], int] = fs_free_bytes,
                 lock_timeout_s: float = LOCK_TIMEOUT_S, max_open_slabs: int = slab.MAX_OPEN,
                 pending_bytes: int = PENDING_BYTES):
        self.cfg = cfg
        self.directory = cachedir.prepare(cfg.path)
        self._free_bytes = free_bytes
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise StoreError(f"store.path {cfg.path!r}: directory is not writable")
        self.o_direct = fdcache.probe_o_direct(self.directory, cfg.o_direct)
        self._slabs = slab.SlabFiles(self.directory, "on" if self.o_direct else "off",
                                     max_open_slabs)
        self._lock = threading.RLock()   # in-memory state and the reader connection
        self._lease: Lease | None = None   # taken under the directory lock (`_take_lease`)
        self._owner = ""
        self._pool = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="offload-io")
        self._stats = StoreStats(capacity=cfg.capacity)
        self._touched: set[bytes] = set()
        self._last_touch_flush = time.monotonic()
        self._orphans: list[Location] = []  # pending slots of failed commits (under wlock)
        self._spare = Spare()                  # reserved slots not written yet (under _lock)
        self._written_back: list[Location] = []   # written slots to give back (under wlock)
        self._not_ours: set[tuple[int, int]] = set()
        self.rebuilt_from: str | None = None
        try:
            self._ix = IndexAccess(self._open_index, lock_timeout_s)
        except BaseException:
            self._pool.shutdown(wait=False)
            self._slabs.close()
            if self._lease is not None:
                self._lease.close()
            raise
        self._seq, keys = self._ix.reader.committed_keys()
        self._keys: set[bytes] = set(keys)
        self._refreshed = self._held_checked = time.monotonic()
        self._commits = Committer(
            lambda segs: coalesce.sync_segments(self._slabs, self._pool, segs),
            self._commit_reserved, self._committed, pending_bytes)
        self._closed = False

    @property
    def _index(self) -> Index:
        """The writer connection, once what was put so far is committed (for tests and `bench
        store`, which peek at the index; the store itself goes through `_ix`)."""
        self._commits.settle(LOCK_TIMEOUT_S)
        return self._ix.writer

    # ---- opening ------------------------------------------------------------------------------

    def _open_index(self, timeout_s: float) -> Index:
        index, aside = open_index(self.directory, self._slabs, capacity=self.cfg.capacity,
                                  segment_size=self.cfg.segment_size, free_slot=self._free_slot,
                                  timeout_s=timeout_s, lease=self._take_lease,
                                  mine=self._lease.token if self._lease else None)
        self.rebuilt_from = aside or self.rebuilt_from
        return index

    def _take_lease(self) -> str:
        """This process's lease on the directory (`owner.py`): the owner token of its slots."""
        if self._lease is None:
            self._lease = Lease(self.directory)
            self._owner = self._lease.token
        return self._owner

    def _free_slot(self, f: Freed) -> None:
        self._slabs.free(f.seg, f.slot_bytes, f.slot)

    def _refresh_keys(self) -> bool:
        """Bring the in-memory key set up to date with commits/deletes of every process (caller
        holds the lock). False if the index stayed busy (the caller misses)."""
        if self._ix.replaced():   # another process set the index aside and rebuilt it
            self._seq = -1
            if not self._ix.reopen(self._lock):
                return False
            self._spare.clear()   # the new index holds no reservation of ours
        now = time.monotonic()
        got = self._ix.reader.changes_since(self._seq) if self._seq >= 0 else None
        if got is None:
            self._seq, keys = self._ix.reader.committed_keys()
            self._keys = set(keys)
            self._refreshed = now
            return True
        self._seq, changes = got
        self._refreshed = now
        for key, op in changes:
            if op == 1:
                self._keys.add(key)
            else:
                self._keys.discard(key)
        return True

    def _drop_missing(self, index: Index) -> None:
        """Drop segments whose slab file was found missing (caller holds the write lock): their
        blocks stop existing and their slots are never reused (else every put of that size fails)."""
        for seg, sb in self._slabs.take_missing():
            gone = index.drop_segment(seg)
            self._slabs.forget(seg, sb)
            with self._lock:
                self._keys.difference_update(gone)
                self._spare.drop_segment(seg)
            log.error("slab %s is missing: its %d blocks are dropped", self._slabs.path(seg, sb),
                      len(gone))

    # ---- data path ----------------------------------------------------------------------------

    @never_raises("disk exists", _absent)
    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            if not self._refresh_keys():
                return [False] * len(keys)
            ks, flying = self._keys, self._commits.in_flight
            return [k in ks or flying(k) for k in keys]

    @never_raises("disk get", _missed)
    def get_many(self, keys: Sequence[bytes], dests: Sequence[Sequence[Buffer]]) -> list[bool]:
        if len(keys) != len(dests):
            log.error("get: %d keys but %d destinations", len(keys), len(dests))
            return [False] * len(keys)
        if any(self._commits.in_flight(k) for k in keys):   # put by this process: durable soon
            self._commits.wait_for(keys, INFLIGHT_WAIT_S)
        with self._lock:
            if self._ix.replaced() and not self._refresh_keys():   # rebuilt by another process
                return _missed(self, keys)
            try:
                locs = self._ix.reader.locate(list(keys))
            except sqlite3.OperationalError as e:
                log.warning("get: %d blocks missed: %s", len(keys), e)
                self._ix.busy += 1
                return _missed(self, keys)
        jobs = []
        bad_sizes: list[Location] = []
        unknown: list[bytes] = []
        for i, (k, bufs) in enumerate(zip(keys, dests)):
            loc = locs.get(k)
            if loc is None:
                unknown.append(k)  # the index does not hold it: stop claiming it exists
                continue
            if total_len(bufs) != loc.length:
                if self._index_lies(loc):
                    bad_sizes.append(loc)
                else:
                    log.error("get %s: destination holds %d bytes, block has %d", k.hex()[:16],
                              total_len(bufs), loc.length)
                continue
            jobs.append((i, loc, bufs))

        outcomes = coalesce.read_batch(self._slabs, self._pool, [j[1] for j in jobs],
                                       [j[2] for j in jobs], self.cfg.io_threads)
        result = [False] * len(keys)
        corrupt: list[Location] = list(bad_sizes)
        why = {loc.key: "corrupt: slot header disagrees with the index" for loc in bad_sizes}
        nbytes = 0
        for (i, loc, _), got in zip(jobs, outcomes):
            if got.ok:
                result[i] = True
                nbytes += loc.length
            elif got.corrupt:   # or reused under this read: `_write_after_get`
                corrupt.append(loc)
                why[loc.key] = got.reason
            else:
                log.warning("block %s is a miss: %s", loc.key.hex()[:16], got.reason)
        hits = sum(result)
        with self._lock:
            self._stats.hits += hits
            self._stats.misses += len(keys) - hits
            self._stats.bytes_read += nbytes
            self._keys.difference_update(unknown)
            self._touched.update(k for k, ok in zip(keys, result) if ok)
            due = time.monotonic() - self._last_touch_flush > TOUCH_FLUSH_S
        if corrupt or due or self._slabs.fds.has_missing():
            self._write_after_get(corrupt, due, why)
        return result

    def _write_after_get(self, corrupt: list[Location], touch: bool,
                         why: dict[bytes, str]) -> None:
        """Drop corrupt blocks, missing slabs and record last use: never waited for (a busy
        index leaves them for the next get).

        A block that failed its checks is corrupt only if the index, under the write lock, still
        holds the very row that was read (same slot, checksum and generation): a slot is handed
        out again only in the transaction that deletes its row (and punches it), so a read that
        landed on a slot being deleted or reused meets a row that is gone or newer. That is "reused
        under me" (a miss, counted in `reused_reads`), not bad bytes on disk (`checksum_failures`)."""
        def run(index: Index) -> None:
            if corrupt:   # a row kept (not the one read: put again meanwhile) stays a key
                gone = index.drop_corrupt(corrupt, self._free_slot)
                with self._lock:
                    self._keys.difference_update(gone)
                    self._stats.checksum_failures += len(gone)
                    self._stats.reused_reads += len(corrupt) - len(gone)
                for k in gone:
                    log.warning("block %s is corrupt (%s): a miss, deleted", k.hex()[:16],
                                why.get(k, "?"))
                if len(gone) < len(corrupt):
                    log.info("%d reads met a slot deleted or reused meanwhile by another process: "
                             "misses, not corruption", len(corrupt) - len(gone))
            self._drop_missing(index)
            if touch:
                self._flush_touches(index)

        self._ix.write(run, wait=0.0 if not corrupt else DATA_LOCK_TIMEOUT_S)

    def _index_lies(self, loc: Location) -> bool:
        """A size mismatch: is the index row damaged (slot header disagrees) or the caller wrong?"""
        h = self._slabs.read_header(loc.seg, loc.slot_bytes, loc.slot)
        return h is None or h.key != loc.key or h.length != loc.length or h.csum != loc.csum

    def _flush_touches(self, index: Index | None = None) -> None:
        """Record last use times (under the write lock; without `index`: takes it)."""
        if index is None:
            self._ix.write(self._flush_touches, control=True)
            return
        with self._lock:
            touched, self._touched = list(self._touched), set()
            self._last_touch_flush = time.monotonic()
        if touched:
            index.touch(touched)

    @never_raises("disk delete", _nothing)
    def delete_many(self, keys: Sequence[bytes]) -> int:
        flying = [k for k in keys if self._commits.in_flight(k)]
        if flying:   # not made visible after all, or deleted once it is
            self._commits.cancel(flying)
            self._commits.wait_for(flying, INFLIGHT_WAIT_S)
        n = self._ix.write(lambda index: index.delete(list(keys), self._free_slot))
        dropped = self._commits.honored(flying) if flying else 0
        if n is BUSY:
            log.warning("delete: the index is busy; %d blocks not deleted", len(keys))
            return dropped
        with self._lock:
            self._keys.difference_update(keys)
        return int(n) + dropped  # type: ignore[arg-type]

    # ---- control path (the rest: disk_admin.DiskAdmin) ---------------------------------------

    def tier_stats(self) -> dict[str, StoreStats]:
        return {"local": self.stats()}

    def stats(self) -> StoreStats:
        self._commits.settle(DATA_LOCK_TIMEOUT_S)   # what was put so far, when it can be seen
        with self._lock:
            blocks, used, cap = self._ix.reader.usage()
            s = StoreStats(**vars(self._stats))
            spare = self._spare.nbytes()
        s.blocks, s.bytes_used, s.capacity = blocks, used, cap
        s.damaged_rows, s.index_busy = self._ix.bad_rows, self._ix.busy
        s.bytes_reserved = spare
        s.extra = {"o_direct": self.o_direct, "directory": self.directory,
                   "rebuilt_from": self.rebuilt_from}
        return s

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._commits.close(LOCK_TIMEOUT_S):
            log.error("closing: blocks written but not yet committed are dropped (reclaimed "
                      "as a dead process's slots)")
        try:
            self._ix.write(self._flush_touches, control=True)
            self._ix.write(self._give_back, control=True)
        except (sqlite3.Error, StoreError) as e:
            log.warning("could not record last use times or give back reserved slots (the "
                        "next open reclaims them): %s", e)
        self._pool.shutdown(wait=True)
        self._slabs.close()
        self._ix.close()
        if self._lease is not None:
            self._lease.close()   # last: its slots are given back (or left for a reclaim)

    def _give_back(self, index: Index) -> None:
        """This process's reserved slots back to the index (under the write lock)."""
        with self._lock:
            spare = self._spare.clear()
        index.return_reserved(spare, self._owner, self._free_slot, punch=False)
        written, self._written_back = self._written_back, []
        index.return_reserved([(loc.slot_bytes, loc.seg, loc.slot) for loc in written],
                              self._owner, self._free_slot, punch=True)

    def __enter__(self) -> "DiskStore":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


__all__ = ["DiskStore", "fs_free_bytes"]
