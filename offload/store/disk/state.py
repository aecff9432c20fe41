"""What the parts of one open disk store share: `DiskState`, and the steps every part takes on it.

`DiskStore` (`store.py`) is a face over parts — `Reads`, `Writes`, `Finish`, `Slots`, `Admin` —
each a plain class handed this one object (and the group committer, `commit.py`). The state holds:
the store's settings and directory, the slab files and I/O pools (`pool` for writes and syncs,
`read_pool` for reads), the index access (`ix`: writer and reader connections,
`disk/index/access.py`), the counters, this process's lease token (`owner`),
the in-memory key set with its change-log position, the hits served from the page cache
(`reads_cached`, `slab/pagecache.py`), the reserved range (`spare.py`) and the slots
a failed commit or a close gives back (`orphans`, `written_back`).

Locks: `lock` (an RLock) guards the key set, the counters that several threads bump, the range and
the reader connection; `ix.wlock` guards the writer connection and `orphans` / `written_back`,
which only an index transaction consumes.

Steps every part takes: `refresh_keys()` (the key set up to date with every process's commits and
deletes), `drop_missing(index)` (segments whose slab file was found missing), `evicted(n)`
(count blocks this process evicted), `free_slot(f)` (a slot the index freed: its hole punched),
`drop_bad(index, locations)` (the one place a block is called bad and deleted: the data path,
`cache verify`; a re-read under the write lock decides, `Index.drop_corrupt`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Callable

from offload.config import StoreConfig
from offload.store.base import StoreStats
from offload.store.disk import scrub
from offload.store.disk.index.access import IndexAccess
from offload.store.disk.index.db import Freed, Index, Location
from offload.store.disk.slab import files as slab
from offload.store.disk.spare import Spare

log = logging.getLogger("offload.store.disk.store")


@dataclass(eq=False)
class DiskState:
    cfg: StoreConfig
    directory: str
    free_bytes: Callable[[str], int]      # the file system's free bytes under a path
    slabs: slab.SlabFiles
    pool: Executor                        # the I/O threads of writes and syncs
    stats: StoreStats
    ix: IndexAccess
    owner: str                            # this process's lease token: the owner of its slots
    seq: int                              # the change-log position `keys` is up to date with
    keys: set[bytes]                      # committed blocks (under `lock`)
    read_pool: Executor                   # the I/O threads of reads: never behind a write
    lock: threading.RLock = field(default_factory=threading.RLock)
    spare: Spare = field(default_factory=Spare)   # reserved slots not written yet (under `lock`)
    orphans: list[Location] = field(default_factory=list)   # pending slots of failed commits
    written_back: list[Location] = field(default_factory=list)   # written slots to give back
    refreshed: float = field(default_factory=time.monotonic)   # the last key-set refresh
    reads_cached: int = 0                 # hits served from the page cache (under `lock`)

    def free_slot(self, f: Freed) -> None:
        self.slabs.free(f.seg, f.slot_bytes, f.slot)

    def drop_bad(self, index: Index, locs: list[Location]) -> list[bytes]:
        """Blocks a read found bad (corrupt, or their slot reused under the read): deleted only
        if the index, under the write lock (caller: inside `ix.write`), still holds the row that
        was read and a re-read of the slot now still finds it corrupt -- the one rule for every
        reader (`get`, `cache verify`). Counted in `checksum_failures`; returns the keys dropped."""
        gone = index.drop_corrupt(locs, self.free_slot, self.still_bad)
        with self.lock:
            self.keys.difference_update(gone)
            self.stats.checksum_failures += len(gone)
        return gone

    def still_bad(self, loc: Location) -> bool:
        """A re-read of a block's slot finds it corrupt now (an I/O error is no proof: False)."""
        return scrub.read_whole(self.slabs, loc).corrupt

    def refresh_keys(self) -> bool:
        """Bring the in-memory key set up to date with commits/deletes of every process (caller
        holds the lock). False if the index stayed busy (the caller misses)."""
        if self.ix.replaced():   # another process set the index aside and rebuilt it
            self.seq = -1
            if not self.ix.reopen(self.lock):
                return False
            self.spare.clear()   # the new index holds no reservation of ours
        now = time.monotonic()
        got = self.ix.reader.changes_since(self.seq) if self.seq >= 0 else None
        if got is None:
            self.seq, keys = self.ix.reader.committed_keys()
            self.keys = set(keys)
            self.refreshed = now
            return True
        self.seq, changes = got
        self.refreshed = now
        for key, op in changes:
            if op == 1:
                self.keys.add(key)
            else:
                self.keys.discard(key)
        return True

    def drop_missing(self, index: Index) -> None:
        """Drop segments whose slab file was found missing (caller holds the write lock): their
        blocks stop existing and their slots are never reused (else every put of that size fails)."""
        for seg, sb in self.slabs.take_missing():
            gone = index.drop_segment(seg)
            self.slabs.forget(seg, sb)
            with self.lock:
                self.keys.difference_update(gone)
                self.spare.drop_segment(seg)
            log.error("slab %s is missing: its %d blocks are dropped", self.slabs.path(seg, sb),
                      len(gone))

    def evicted(self, n: int) -> None:
        """Blocks this process just evicted: counted, and the next put reads the change log (its
        key set names them until then)."""
        if n:
            self.stats.evictions += n
            self.refreshed = float("-inf")


__all__ = ["DiskState"]
