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
written since its last round visible in one synced transaction (`disk/finish.py`): other
processes, and a restart after a crash, see a block only once it is durable. This process counts
its blocks in flight as stored (exists says yes, a put skips them) and a get of one waits for its
commit (then reads it as any other).
`flush()` waits for all; `close()` flushes. A crash at any point leaves at most pending slots of a
dead process, reclaimed on the next open or under pressure; a failed commit frees its slots (or
the next reservation does, if the index could not be written then).
Get (`disk/reads.py`): locate in the index -> the I/O threads read header + data straight into the
caller's buffers -> the header must match the index and the data its checksum, else the block is
deleted and it is a miss.
Open (`recovery.Opener`): the directory is checked or created 0700 (`cachedir.prepare`: owned by
the service user, writable by nobody else); under the lock file, taken with a deadline,
`PRAGMA quick_check` (an index another process keeps locked is waited for, never damage); a
damaged index is set aside (`index.db.damaged-<time>`) and rebuilt from the slab headers, unless
another process has the directory open (then a `StoreError`); segments whose slab file is missing
are dropped; this process's lease is taken (`owner.py`: the kernel's OFD lock says who is alive);
dead processes' slots are reclaimed.
A slab found missing later (a read, a write, a sync) is dropped the same way.

The face: `DiskStore` opens the directory and builds the parts on one shared `DiskState`
(`disk/state.py`: lock, key set, index access, slab files, pool, counters, range, owner): `Reads`,
`Writes`, `Finish` (the commits), `Slots` (`disk/slots.py`, the `SlotStore` side) and `Admin`
(`disk/admin.py`, the control path) — plain classes, each with its own methods — and delegates
every public call to them.

The data path (put/get/exists/delete) never raises (`never_raises`, on the face's methods): it
returns per-block flags and logs why. It never waits on the index longer than
`DATA_LOCK_TIMEOUT_S` (`disk/index/access.py`: reads and writes go through separate connections, so
gets go on while a write waits), a put (a writer's own thread) `PUT_WAIT_S` (`disk/writes.py`);
past that a read is a miss and a write is skipped, counted in
`stats().index_busy`; an index row that fails the range checks is a miss for that block and
dropped, counted in `stats().damaged_rows`.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from offload.config import StoreConfig
from offload.errors import StoreError
from offload.keys import Namespace
from offload.store.base import Backlog, Buffer, Slot, SlotMedium, StoreStats, never_raises
from offload.store.disk import cachedir
from offload.store.disk.admin import Admin
from offload.store.disk.commit import Committer
from offload.store.disk.finish import Finish
from offload.store.disk.index.access import DATA_LOCK_TIMEOUT_S, LOCK_TIMEOUT_S, IndexAccess
from offload.store.disk.index.db import Index
from offload.store.disk.reads import Reads, missed
from offload.store.disk.recovery import Opener
from offload.store.disk.slab import coalesce, fdcache
from offload.store.disk.slab import files as slab
from offload.store.disk.slab.format import ReadOutcome
from offload.store.disk.slab.gate import IoGate
from offload.store.disk.slots import SlotBooks, Slots
from offload.store.disk.state import DiskState
from offload.store.disk.writes import Writes, skipped

log = logging.getLogger(__name__)

PENDING_BYTES = 256 << 20   # written but not yet visible (the group committer's bound)


def _missed(self: "DiskStore", keys: Sequence[bytes], *_: Any) -> list[bool]:
    return missed(self._state.stats, keys)


def _skipped(self: "DiskStore", keys: Sequence[bytes], *_: Any) -> list[bool]:
    return skipped(self._state.stats, keys)


def _absent(_self: "DiskStore", keys: Sequence[bytes], *_: Any) -> list[bool]:
    return [False] * len(keys)


def _nothing(*_: Any) -> int:
    return 0


def _none_each(_self: "DiskStore", keys: Sequence[Any], *_: Any) -> list[None]:
    return [None] * len(keys)


def _abort_all(self: "DiskStore", slots: Sequence[Slot], *_: Any) -> list[bool]:
    self.abort_slots(slots)      # guarded itself: never raises
    return [False] * len(slots)


def fs_free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class DiskStore:
    slot_medium: SlotMedium = "file"

    def __init__(self, cfg: StoreConfig, *, free_bytes: Callable[[str], int] = fs_free_bytes,
                 lock_timeout_s: float = LOCK_TIMEOUT_S, max_open_slabs: int = slab.MAX_OPEN,
                 pending_bytes: int = PENDING_BYTES, gate: IoGate | None = None):
        self.cfg = cfg
        self.directory = cachedir.prepare(cfg.path)
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise StoreError(f"store.path {cfg.path!r}: directory is not writable")
        self.o_direct = fdcache.probe_o_direct(self.directory, cfg.o_direct)
        slabs = slab.SlabFiles(self.directory, "on" if self.o_direct else "off", max_open_slabs,
                               gate, cfg.page_cache)
        pool = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="offload-io")
        # reads on threads of their own: a read's runs never queue behind a write's in a pool
        # (at the device, the slabs' gate puts them first: `slab/gate.py`)
        read_pool = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="offload-read")
        self._opener = Opener(self.directory, slabs, cfg.capacity, cfg.segment_size)
        try:
            ix = IndexAccess(self._opener.open, lock_timeout_s)
        except BaseException:
            pool.shutdown(wait=False)
            read_pool.shutdown(wait=False)
            slabs.close()
            self._opener.close()
            raise
        seq, keys = ix.reader.committed_keys()
        self._state = st = DiskState(cfg, self.directory, free_bytes, slabs, pool,
                                     StoreStats(capacity=cfg.capacity), ix, self._opener.owner,
                                     seq, set(keys), read_pool)
        finish = Finish(st)
        self._commits = Committer(lambda segs: coalesce.sync_segments(slabs, pool, segs),
                                  finish.commit_reserved, finish.committed, pending_bytes,
                                  quiet=slabs.gate.quiet)
        self._reads = Reads(st, self._commits)
        self._writes = Writes(st, self._commits)
        self._slots = Slots(st, self._commits, finish)
        self._admin = Admin(st, self._commits)
        self._closed = False

    @property
    def rebuilt_from(self) -> str | None:
        """Where a damaged index was set aside at open (or at a reopen), else None."""
        return self._opener.rebuilt_from

    @property
    def _index(self) -> Index:
        """The writer connection, once what was put so far is committed (for tests and `bench
        store`, which peek at the index; the store itself goes through `DiskState.ix`)."""
        self._commits.settle(LOCK_TIMEOUT_S)
        return self._state.ix.writer

    # ---- data path (`reads.py`, `writes.py`) -------------------------------------------------

    @never_raises("disk exists", _absent)
    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self._reads.exists_many(keys)

    @never_raises("disk get", _missed)
    def get_many(self, keys: Sequence[bytes], dests: Sequence[Sequence[Buffer]]) -> list[bool]:
        return self._reads.get_many(keys, dests)

    @never_raises("disk put", _skipped)
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]) -> list[bool]:
        """Write the blocks; True once written (visible once durable: `Writes.put_many`)."""
        return self._writes.put_many(keys, blocks)

    @never_raises("disk put (promotion)", _skipped)
    def promote_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]
                     ) -> list[bool]:
        """`put_many` on a read's path (a block a get found in a shared tier, copied here): it
        waits for the index no longer than a read does (`DATA_LOCK_TIMEOUT_S`), then skips."""
        return self._writes.put_many(keys, blocks, wait_s=DATA_LOCK_TIMEOUT_S)

    @never_raises("disk delete", _nothing)
    def delete_many(self, keys: Sequence[bytes]) -> int:
        return self._writes.delete_many(keys)

    @never_raises("disk durable", _absent)
    def durable(self, keys: Sequence[bytes], hurry: bool = True) -> list[bool]:
        """Per key, whether this process's put of it is stored durably now (`Writes.durable`)."""
        return self._writes.durable(keys, hurry)

    def commit_now(self) -> None:
        """Start the group committer's next round now, without waiting for it."""
        self._writes.commit_now()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block put so far is durable and visible (`Writes.flush`)."""
        return self._writes.flush(timeout)

    def backlog(self) -> dict[str, Backlog]:
        """Blocks this process put that are written but not yet durable (the group committer's)."""
        return {"local": self._commits.backlog()}

    # ---- slots (`slots.py`) ------------------------------------------------------------------

    def slot_books(self) -> SlotBooks:
        return self._slots.books()

    def arena_region(self) -> tuple[int, int] | None:
        return None      # file slots: nothing to register in memory

    @never_raises("reserve_slots", _none_each)
    def reserve_slots(self, keys: Sequence[bytes], sizes: Sequence[int]) -> list[Slot | None]:
        return self._slots.reserve_slots(keys, sizes)

    @never_raises("commit_slots", _abort_all)
    def commit_slots(self, slots: Sequence[Slot], checksums: Sequence[int] | None = None
                     ) -> list[bool]:
        return self._slots.commit_slots(slots, checksums)

    @never_raises("abort_slots (the slots are reclaimed when this process ends)", lambda *_: None)
    def abort_slots(self, slots: Sequence[Slot]) -> None:
        self._slots.abort_slots(slots)

    @never_raises("pin_slots", _none_each)
    def pin_slots(self, keys: Sequence[bytes]) -> list[Slot | None]:
        return self._slots.pin_slots(keys)

    @never_raises("unpin_slots", lambda *_: None)
    def unpin_slots(self, slots: Sequence[Slot], ok: Sequence[bool] | None = None) -> None:
        self._slots.unpin_slots(slots, ok)

    # ---- control path (`admin.py`) -----------------------------------------------------------

    def register_namespace(self, ns: Namespace) -> None:
        self._admin.register_namespace(ns)

    def clear(self, namespace: bytes | None = None) -> int:
        """Delete every block, or every block of one namespace digest (16 bytes)."""
        return self._admin.clear(namespace)

    def evict_to(self, used_bytes: int) -> int:
        """Evict least-recently-used blocks until at most `used_bytes` are used."""
        return self._admin.evict_to(used_bytes)

    def summary(self) -> dict[str, Any]:
        """Blocks, bytes and age per namespace (with descriptions): `cache stats`."""
        return self._admin.summary()

    def verify(self, progress: Callable[[int], None] | None = None,
               batch: int = 64) -> tuple[int, list[tuple[bytes, ReadOutcome]]]:
        """Re-read every committed block; corrupt ones are deleted (`Admin.verify`)."""
        return self._admin.verify(progress, batch)

    def tier_stats(self) -> dict[str, StoreStats]:
        return {"local": self.stats()}

    def stats(self) -> StoreStats:
        st = self._state
        self._commits.settle(DATA_LOCK_TIMEOUT_S)   # what was put so far, when it can be seen
        with st.lock:
            blocks, used, cap = st.ix.reader.usage()
            s = StoreStats(**vars(st.stats))
            spare = st.spare.nbytes()
        s.blocks, s.bytes_used, s.capacity = blocks, used, cap
        s.damaged_rows, s.index_busy = st.ix.bad_rows, st.ix.busy
        s.bytes_reserved = spare
        gate = st.slabs.gate
        cache = st.slabs.cache
        s.extra = {"o_direct": self.o_direct, "directory": self.directory,
                   # the page-cache share (`slab/pagecache.py`): hits served from it, bytes kept
                   "reads_cached": st.reads_cached,
                   "page_cache_held": cache.held() if cache is not None else 0,
                   "rebuilt_from": self.rebuilt_from,
                   # reads before writes (`slab/gate.py`): write calls held back by a read,
                   # commit rounds whose flushes waited for reads
                   "writes_held": gate.writes_held, "flushes_delayed": gate.quiet_waits}
        return s

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        st = self._state
        if not self._commits.close(LOCK_TIMEOUT_S):
            log.error("closing: blocks written but not yet committed are dropped (reclaimed "
                      "as a dead process's slots)")
        try:
            st.ix.write(self._reads.flush_touches, control=True)
            st.ix.write(self._writes.give_back, control=True)
        except (sqlite3.Error, StoreError) as e:
            log.warning("could not record last use times or give back reserved slots (the "
                        "next open reclaims them): %s", e)
        st.pool.shutdown(wait=True)
        st.read_pool.shutdown(wait=True)
        st.slabs.close()
        st.ix.close()
        self._opener.close()   # last: its slots are given back (or left for a reclaim)

    def __enter__(self) -> "DiskStore":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


__all__ = ["DiskStore", "fs_free_bytes"]
