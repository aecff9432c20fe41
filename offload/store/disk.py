"""The NVMe block store: slab files + a crash-safe SQLite index + a checksum on every block.

`DiskStore(StoreConfig)` opens (or creates) one cache directory. Any number of processes may open the
same directory at once (tensor-parallel ranks, replicas on one node): the index serialises the
bookkeeping, slots are owned by exactly one block, and the capacity cap lives in the index, so it
holds for all of them together.

Put: skip keys already stored -> reserve slots in one transaction (evicting least-recently-used blocks
past the high watermark, down to the low one; skipping blocks when the cap or the file system is full)
-> the I/O threads checksum and write each block (header + data, O_DIRECT, vectored) -> fdatasync of
each touched slab -> one transaction makes the blocks visible. A crash at any point leaves at most
pending slots of a dead process, reclaimed on the next open or under pressure.
Get: locate in the index -> the I/O threads read header + data straight into the caller's buffers ->
the header must match the index and the data its checksum, else the block is deleted and it is a miss.
Open (`recovery.open_index`): the directory is checked or created 0700 (`cachedir.prepare`: owned by
the service user, writable by nobody else); under the lock file, taken with a deadline,
`PRAGMA quick_check`; a damaged index is set aside (`index.db.damaged-<time>`) and rebuilt from the
slab headers; segments whose slab file is missing are dropped; dead processes' slots are reclaimed.
A slab found missing later (a read, a write, a sync) is dropped the same way.

The data path (put/get/exists/delete) never raises (`never_raises`): it returns per-block flags and
logs why. Where it must reopen the index (another process rebuilt it) it waits for the lock at most
`DATA_LOCK_TIMEOUT_S`, else misses.
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
from offload.keys import KEY_BYTES, NS_BYTES, Namespace
from offload.store import cachedir, coalesce, fdcache, scrub, slab, slot_format
from offload.store.base import Buffer, StoreStats, never_raises, total_len
from offload.store.disk_slots import SlotAccess, SlotBooks
from offload.store.index import Allocation, Freed, Index, Location
from offload.store.owner import owner_token
from offload.store.recovery import INDEX_NAME, open_index

log = logging.getLogger(__name__)

TOUCH_FLUSH_S = 1.0
LOCK_TIMEOUT_S = 60.0       # opening: long enough for another process's index rebuild
DATA_LOCK_TIMEOUT_S = 0.5   # a reopen on the data path: misses rather than a stalled server


def _skipped(self: "DiskStore", keys: Sequence[bytes], *_: Any) -> list[bool]:
    self._stats.put_skipped += len(keys)
    return [False] * len(keys)


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


class DiskStore(SlotAccess):
    def __init__(self, cfg: StoreConfig, *, free_bytes: Callable[[str], int] = fs_free_bytes,
                 lock_timeout_s: float = LOCK_TIMEOUT_S, max_open_slabs: int = slab.MAX_OPEN):
        self.cfg = cfg
        self.directory = cachedir.prepare(cfg.path)
        self._free_bytes = free_bytes
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise StoreError(f"store.path {cfg.path!r}: directory is not writable")
        self.o_direct = fdcache.probe_o_direct(self.directory, cfg.o_direct)
        self._slabs = slab.SlabFiles(self.directory, "on" if self.o_direct else "off",
                                     max_open_slabs)
        self._lock = threading.RLock()
        self._owner = owner_token()
        self._pool = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="offload-io")
        self._stats = StoreStats(capacity=cfg.capacity)
        self._touched: set[bytes] = set()
        self._last_touch_flush = time.monotonic()
        self.rebuilt_from: str | None = None
        self._index = self._open_index(lock_timeout_s)
        self._seq, keys = self._index.committed_keys()
        self._keys: set[bytes] = set(keys)
        self._closed = False

    # ---- opening ------------------------------------------------------------------------------

    def _open_index(self, timeout_s: float) -> Index:
        index, aside = open_index(self.directory, self._slabs, capacity=self.cfg.capacity,
                                  segment_size=self.cfg.segment_size, free_slot=self._free_slot,
                                  timeout_s=timeout_s)
        self.rebuilt_from = aside or self.rebuilt_from
        return index

    def _free_slot(self, f: Freed) -> None:
        self._slabs.free(f.seg, f.slot_bytes, f.slot)

    def _refresh_keys(self) -> None:
        """Bring the in-memory key set up to date with commits/deletes of every process."""
        try:
            ino = os.stat(os.path.join(self.directory, INDEX_NAME)).st_ino
        except OSError:
            ino = -1
        if ino != self._index.ino:  # another process set the index aside and rebuilt it
            fresh = self._open_index(DATA_LOCK_TIMEOUT_S)  # StoreError -> the caller's misses
            self._index.close()
            self._index, self._seq = fresh, -1
        self._drop_missing()
        got = self._index.changes_since(self._seq) if self._seq >= 0 else None
        if got is None:
            self._seq, keys = self._index.committed_keys()
            self._keys = set(keys)
            return
        self._seq, changes = got
        for key, op in changes:
            if op == 1:
                self._keys.add(key)
            else:
                self._keys.discard(key)

    def _drop_missing(self) -> None:
        """Drop segments whose slab file was found missing (caller holds the lock): their blocks
        stop existing and their slots are never reused (else every put of that size would fail)."""
        for seg, sb in self._slabs.take_missing():
            gone = self._index.drop_segment(seg)
            self._slabs.forget(seg, sb)
            self._keys.difference_update(gone)
            log.error("slab %s is missing: its %d blocks are dropped", self._slabs.path(seg, sb),
                      len(gone))

    # ---- data path ----------------------------------------------------------------------------

    @never_raises("disk exists", _absent)
    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            self._refresh_keys()
            ks = self._keys
            return [k in ks for k in keys]

    @never_raises("disk put", _skipped)
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]) -> list[bool]:
        if len(keys) != len(blocks):
            log.error("put: %d keys but %d blocks; nothing stored", len(keys), len(blocks))
            return [False] * len(keys)
        result = [False] * len(keys)
        items: list[tuple[bytes, int, int, int]] = []
        where: dict[bytes, list[int]] = {}
        bufs_of: dict[bytes, Sequence[Buffer]] = {}
        with self._lock:
            self._refresh_keys()
            for i, (k, bufs) in enumerate(zip(keys, blocks)):
                if len(k) != KEY_BYTES:
                    log.error("put: key of %d bytes (want %d) skipped", len(k), KEY_BYTES)
                    continue
                if k in self._keys:
                    result[i] = True
                    continue
                if k not in where:
                    n = total_len(bufs)
                    items.append((k, n, slot_format.slot_bytes_for(n), 0))
                    bufs_of[k] = bufs
                where.setdefault(k, []).append(i)
            if not items:
                return result
            alloc = self._allocate(items)
        for k in alloc.present:
            for i in where[k]:
                result[i] = True
        for k, why in alloc.skipped.items():
            log.warning("block %s not stored: %s", k.hex()[:16], why)
            self._stats.put_skipped += 1
        outcomes = coalesce.write_batch(self._slabs, self._pool, alloc.new,
                                        [bufs_of[loc.key] for loc in alloc.new], time.time_ns(),
                                        self.cfg.io_threads)
        good: list[tuple[bytes, int]] = []
        failed: list[Location] = []
        for loc, (err, csum) in zip(alloc.new, outcomes):
            if err:
                log.warning("block %s not stored: %s", loc.key.hex()[:16], err)
                self._stats.put_skipped += 1
                failed.append(loc)
            else:
                good.append((loc.key, csum))
        with self._lock:
            touched, self._touched = list(self._touched), set()
            self._index.finish(good, failed, touched, self._free_slot)
            self._drop_missing()
            for k, _ in good:
                self._keys.add(k)
                for i in where[k]:
                    result[i] = True
            self._stats.puts += len(good)
            self._stats.bytes_written += sum(total_len(bufs_of[k]) for k, _ in good)
        return result

    def _allocate(self, items: list[tuple[bytes, int, int, int]]) -> Allocation:
        """Reserve slots (caller holds the lock and has refreshed the key set)."""
        alloc = self._index.allocate(
            items, self._owner, high=self.cfg.high_watermark, low=self.cfg.low_watermark,
            free_bytes=lambda: self._free_bytes(self.directory), min_free=self.cfg.min_free,
            segment_size=self.cfg.segment_size, create_segment=self._slabs.create,
            free_slot=self._free_slot)
        self._stats.evictions += alloc.evicted
        return alloc

    @never_raises("disk get", _missed)
    def get_many(self, keys: Sequence[bytes], dests: Sequence[Sequence[Buffer]]) -> list[bool]:
        if len(keys) != len(dests):
            log.error("get: %d keys but %d destinations", len(keys), len(dests))
            return [False] * len(keys)
        with self._lock:
            locs = self._index.locate(list(keys))
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

        errs = coalesce.read_batch(self._slabs, self._pool, [j[1] for j in jobs],
                                   [j[2] for j in jobs], self.cfg.io_threads)
        result = [False] * len(keys)
        corrupt: list[Location] = list(bad_sizes)
        nbytes = 0
        for (i, loc, _), err in zip(jobs, errs):
            if not err:
                result[i] = True
                nbytes += loc.length
            else:
                log.warning("block %s is a miss: %s", loc.key.hex()[:16], err)
                if err.startswith("corrupt"):
                    corrupt.append(loc)
        hits = sum(result)
        with self._lock:
            self._stats.hits += hits
            self._stats.misses += len(keys) - hits
            self._stats.checksum_failures += len(corrupt)
            self._stats.bytes_read += nbytes
            self._keys.difference_update(unknown)
            if corrupt:
                self._index.drop_corrupt(corrupt, self._free_slot)
                for loc in corrupt:
                    self._keys.discard(loc.key)
            self._drop_missing()
            self._touched.update(k for k, ok in zip(keys, result) if ok)
            if time.monotonic() - self._last_touch_flush > TOUCH_FLUSH_S:
                self._flush_touches()
        return result

    def _index_lies(self, loc: Location) -> bool:
        """A size mismatch: is the index row damaged (slot header disagrees) or the caller wrong?"""
        h = self._slabs.read_header(loc.seg, loc.slot_bytes, loc.slot)
        return h is None or h.key != loc.key or h.length != loc.length or h.csum != loc.csum

    def _flush_touches(self) -> None:
        touched, self._touched = list(self._touched), set()
        self._last_touch_flush = time.monotonic()
        if touched:
            self._index.touch(touched)

    @never_raises("disk delete", _nothing)
    def delete_many(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            n = self._index.delete(list(keys), self._free_slot)
            self._keys.difference_update(keys)
            return n

    # ---- what the slot API (disk_slots.SlotAccess, for the GDS path) may use ---------------------

    def slot_books(self) -> SlotBooks:
        return SlotBooks(self._slabs, self._stats, self._slot_allocate, self._slot_finish,
                         self._slot_locate)

    def _slot_allocate(self, items: list[tuple[bytes, int]]) -> list[Location]:
        with self._lock:
            self._refresh_keys()
            todo = [(k, n, slot_format.slot_bytes_for(n), 0) for k, n in items if k not in self._keys]
            return self._allocate(todo).new if todo else []

    def _slot_finish(self, good: list[tuple[bytes, int]], failed: list[Location]) -> None:
        with self._lock:
            self._index.finish(good, failed, [], self._free_slot)
            self._keys.update(k for k, _ in good)

    def _slot_locate(self, keys: list[bytes]) -> dict[bytes, Location]:
        with self._lock:
            return self._index.locate(keys)

    # ---- control path -------------------------------------------------------------------------

    def register_namespace(self, ns: Namespace) -> None:
        with self._lock:
            self._index.record_namespace(ns.digest(), ns.describe())

    def clear(self, namespace: bytes | None = None) -> int:
        """Delete every block, or every block of one namespace digest (16 bytes)."""
        if namespace is not None and len(namespace) != NS_BYTES:
            raise StoreError(f"namespace digest must be {NS_BYTES} bytes")
        with self._lock:
            self._refresh_keys()
            keys = [k for k in self._keys if namespace is None or k[:NS_BYTES] == namespace]
        return self.delete_many(keys)

    def evict_to(self, used_bytes: int) -> int:
        """Evict least-recently-used blocks until at most `used_bytes` are used."""
        with self._lock:
            n = self._index.evict_to(used_bytes, self._free_slot)
            self._seq = -1  # reload the key set on next use
            self._refresh_keys()
            return n

    def tier_stats(self) -> dict[str, StoreStats]:
        return {"local": self.stats()}

    def stats(self) -> StoreStats:
        with self._lock:
            blocks, used, cap = self._index.usage()
        s = StoreStats(**vars(self._stats))
        s.blocks, s.bytes_used, s.capacity = blocks, used, cap
        s.extra = {"o_direct": self.o_direct, "directory": self.directory,
                   "rebuilt_from": self.rebuilt_from}
        return s

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            try:
                self._flush_touches()
            except sqlite3.Error as e:
                log.warning("could not record last use times: %s", e)
            self._pool.shutdown(wait=True)
            self._slabs.close()
            self._index.close()

    def __enter__(self) -> "DiskStore":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ---- maintenance (`sglang-offload cache`) ----------------------------------------------------

    def summary(self) -> dict[str, object]:
        """Blocks, bytes and age per namespace (with descriptions): `cache stats`."""
        with self._lock:
            return self._index.summary()

    def verify(self, progress: Callable[[int], None] | None = None,
               batch: int = 64) -> tuple[int, list[tuple[bytes, str]]]:
        """Re-read every committed block and check header and checksum; corrupt ones are deleted.

        Safe while other processes use the directory: a block deleted or evicted meanwhile is
        not counted as bad. `progress(n)` is called after each batch of n blocks.
        Returns (blocks checked, [(key, why)] of the bad ones).
        """
        def drop(loc: Location, corrupt: bool) -> bool:
            with self._lock:
                if corrupt:
                    still = self._index.drop_corrupt([loc], self._free_slot)
                    self._keys.discard(loc.key)
                    self._stats.checksum_failures += still
                    return bool(still)
                return bool(self._index.locate([loc.key]))

        def page(after: bytes) -> list[Location]:
            with self._lock:
                return self._index.committed_after(after, batch)

        return scrub.scan(self._slabs, self._pool, page, drop, progress)


__all__ = ["DiskStore", "fs_free_bytes"]
