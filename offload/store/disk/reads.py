"""A disk store's read side: exists, get, and what a get writes after it.

`Reads(state, commits)`: `exists_many` (the key set, refreshed from the change log, or in flight in
this process), `get_many` (a key in flight waits for its commit; locate in the index -> the I/O
threads read header + data straight into the caller's buffers, from the page cache where the
kernel holds the whole block (`slab/pagecache.py`, counted in `reads_cached`) -> the header must
match the index and the data its checksum, else the block is deleted and it is a miss),
`flush_touches` (record last use times; a get does it at most every `TOUCH_FLUSH_S`, never waiting
for the index). The face (`store.py`) guards the public calls (`never_raises`).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from typing import Sequence

from offload.store.base import Buffer, StoreStats, total_len
from offload.store.disk.commit import Committer
from offload.store.disk.index.access import DATA_LOCK_TIMEOUT_S
from offload.store.disk.index.db import Index, Location
from offload.store.disk.slab import coalesce
from offload.store.disk.state import DiskState

log = logging.getLogger("offload.store.disk.store")

TOUCH_FLUSH_S = 1.0
INFLIGHT_WAIT_S = 1.0       # a get of a block this process put waits this long for its commit


def missed(stats: StoreStats, keys: Sequence[bytes]) -> list[bool]:
    """A get that found nothing: counted, one False per key."""
    stats.misses += len(keys)
    return [False] * len(keys)


class Reads:
    def __init__(self, state: DiskState, commits: Committer):
        self.state, self.commits = state, commits
        self._touched: set[bytes] = set()   # got since the last `flush_touches` (under the lock)
        self._last_touch_flush = time.monotonic()

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        st = self.state
        with st.lock:
            if not st.refresh_keys():
                return [False] * len(keys)
            ks, flying = st.keys, self.commits.in_flight
            return [k in ks or flying(k) for k in keys]

    def get_many(self, keys: Sequence[bytes], dests: Sequence[Sequence[Buffer]]) -> list[bool]:
        st = self.state
        if len(keys) != len(dests):
            log.error("get: %d keys but %d destinations", len(keys), len(dests))
            return [False] * len(keys)
        if any(self.commits.in_flight(k) for k in keys):   # put by this process: durable soon
            self.commits.wait_for(keys, INFLIGHT_WAIT_S)
        with st.lock:
            if st.ix.replaced() and not st.refresh_keys():   # rebuilt by another process
                return missed(st.stats, keys)
            try:
                locs = st.ix.reader.locate(list(keys))
            except sqlite3.OperationalError as e:
                log.warning("get: %d blocks missed: %s", len(keys), e)
                st.ix.busy += 1
                return missed(st.stats, keys)
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

        outcomes = coalesce.read_batch(st.slabs, st.read_pool, [j[1] for j in jobs],
                                       [j[2] for j in jobs], st.cfg.io_threads)
        result = [False] * len(keys)
        corrupt: list[Location] = list(bad_sizes)
        why = {loc.key: "corrupt: slot header disagrees with the index" for loc in bad_sizes}
        nbytes = cached = 0
        for (i, loc, _), got in zip(jobs, outcomes):
            if got.ok:
                result[i] = True
                nbytes += loc.length
                cached += got.cached
            elif got.corrupt:   # or reused under this read: `_write_after_get`
                corrupt.append(loc)
                why[loc.key] = got.reason
            else:
                log.warning("block %s is a miss: %s", loc.key.hex()[:16], got.reason)
        hits = sum(result)
        with st.lock:
            st.stats.hits += hits
            st.stats.misses += len(keys) - hits
            st.stats.bytes_read += nbytes
            st.reads_cached += cached
            st.keys.difference_update(unknown)
            self._touched.update(k for k, ok in zip(keys, result) if ok)
            due = time.monotonic() - self._last_touch_flush > TOUCH_FLUSH_S
        if corrupt or due or st.slabs.fds.has_missing():
            self._write_after_get(corrupt, due, why)
        return result

    def _write_after_get(self, corrupt: list[Location], touch: bool,
                         why: dict[bytes, str]) -> None:
        """Drop corrupt blocks, missing slabs and record last use: never waited for (a busy
        index leaves them for the next get).

        A block that failed its checks is corrupt only if the index, under the write lock, still
        holds the very row that was read (same slot, checksum and generation) and a re-read of
        its slot there still fails (`DiskState.drop_bad`, the rule `cache verify` follows too): a
        slot is handed out again only after the transaction that deletes its row, so a read that
        landed on a slot being deleted or reused meets a row that is gone or newer. That is "reused
        under me" (a miss, counted in `reused_reads`), not bad bytes on disk (`checksum_failures`)."""
        st = self.state

        def run(index: Index) -> None:
            if corrupt:   # a row kept (not the one read, or good on a re-read) stays a key
                gone = st.drop_bad(index, corrupt)
                with st.lock:
                    st.stats.reused_reads += len(corrupt) - len(gone)
                for k in gone:
                    log.warning("block %s is corrupt (%s): a miss, deleted", k.hex()[:16],
                                why.get(k, "?"))
                if len(gone) < len(corrupt):
                    log.info("%d reads met a slot deleted or reused meanwhile by another process: "
                             "misses, not corruption", len(corrupt) - len(gone))
            st.drop_missing(index)
            if touch:
                self.flush_touches(index)

        st.ix.write(run, wait=0.0 if not corrupt else DATA_LOCK_TIMEOUT_S)

    def _index_lies(self, loc: Location) -> bool:
        """A size mismatch: is the index row damaged (slot header disagrees) or the caller wrong?"""
        h = self.state.slabs.read_header(loc.seg, loc.slot_bytes, loc.slot)
        return h is None or h.key != loc.key or h.length != loc.length or h.csum != loc.csum

    def flush_touches(self, index: Index | None = None) -> None:
        """Record last use times (under the write lock; without `index`: takes it)."""
        if index is None:
            self.state.ix.write(self.flush_touches, control=True)
            return
        with self.state.lock:
            touched, self._touched = list(self._touched), set()
            self._last_touch_flush = time.monotonic()
        if touched:
            index.touch(touched)


__all__ = ["INFLIGHT_WAIT_S", "Reads", "TOUCH_FLUSH_S", "missed"]
