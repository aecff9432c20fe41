"""Opening a cache directory's index, with recovery: what `DiskStore` does under the directory lock.

`open_index(directory, slabs, ...)`: under the lock file (taken with a deadline), list the slab
files, open the index and `PRAGMA quick_check` it. The index is trusted only if it is sound and
complete: it must name every slab file that holds data. A missing, zero-length, damaged (SQLite
errors, quick_check, unknown schema) or incomplete index (e.g. left empty by a rebuild killed
halfway by an older version) beside slab files is rebuilt from the slab headers — but only when no
other process holds a lease on the directory (`owner.py`): a live writer keeps committing into the
index it has open, so a rebuild beside it would lose its blocks; the open then fails with a
`StoreError` and changes nothing (the first open alone rebuilds). "database is locked" is never
damage: an index another process holds SQLite's write lock on (paused mid-transaction) is waited
for until the deadline (`timeout_s`, the lock file's wait included), then a `StoreError`.

A rebuild is a transaction: the new index is built aside (`index.db.rebuild`), checkpointed and
fsync'ed; only then is the old one set aside (`index.db.<why>-<time>`, with its -wal/-shm) and the
new one renamed into place, the directory fsync'ed. A kill at any point leaves the old index
(rebuilt again on the next open) or no index (rebuilt) or the complete new one, never an empty one
that looks valid; a leftover `index.db.rebuild` is simply built again. A freed slot's header never
names a block (hole punched or zeroed), and slots the old index still held as tombstones are freed
again (read from the set-aside copy where it can be read), so nothing deleted comes back.

Everything found on disk is hostile: a slab name must be canonical (`segment_name` of its own
numbers) with a segment id, slot size and slot count in range; a header must name a key once, with
a length of its slot's size class. Anything else is skipped and counted (`Scan`), never raised.

After that: a segment whose slab file is missing or is not a regular file is dropped (its blocks
stop existing, its slots are never handed out again); dead processes' pending slots are reclaimed
and tombstoned slots punched again. Returns the index and where an old one was set aside (None if
it was sound or missing).

`Opener`: one store's `open_index` (what `IndexAccess` calls to open and reopen), holding the
store's lease and where a rebuild set the old index aside.

`step(name)` is called at each step of a rebuild (a fault-injection point for the tests).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import time
from dataclasses import dataclass, field
from typing import Callable

from offload.errors import StoreError
from offload.store.disk import cachedir
from offload.store.disk.index.access import is_busy
from offload.store.disk.index.db import SIDE_FILES, Freed, Index
from offload.store.disk.index.schema import MAX_LENGTH, MAX_SEG, read_only
from offload.store.disk.location import SlotAddr
from offload.store.disk.owner import Lease, live_leases
from offload.store.disk.slab import files as slab
from offload.store.disk.slab import format as slot_format

log = logging.getLogger(__name__)

INDEX_NAME = "index.db"
LOCK_NAME = "lock"
REBUILD_SUFFIX = ".rebuild"
MAX_SLAB_SLOTS = 1 << 22   # more slots than any segment has: a hostile or damaged file


def step(name: str) -> None:
    """A rebuild step is about to run (tests replace this to kill or fail there)."""


@dataclass
class Scan:
    """The slab files of a directory: (seg, slot_bytes, size) of each usable one, and how many
    names or files were skipped (each logged)."""
    slabs: list[tuple[int, int, int]] = field(default_factory=list)
    skipped: int = 0

    def with_data(self) -> set[tuple[int, int]]:
        return {(seg, sb) for seg, sb, size in self.slabs if size > 0}


def parse_slab_name(name: str) -> tuple[int, int] | None:
    """(seg, slot_bytes) of a canonical slab name with numbers in range, else None."""
    parsed = slot_format.parse_segment_name(name)
    if parsed is None:
        return None
    seg, sb = parsed
    if (seg > MAX_SEG or sb < slot_format.HEADER_BYTES or sb % slot_format.ALIGN
            or sb > slot_format.slot_bytes_for(MAX_LENGTH) or slot_format.segment_name(seg, sb) != name):
        return None
    return seg, sb


def scan_slabs(directory: str) -> Scan:
    out = Scan()
    for name in sorted(os.listdir(directory)):
        parsed = parse_slab_name(name)
        if parsed is None:
            if name.endswith(".slab"):
                log.error("%s: not a slab name this store writes (numbers out of range or not "
                          "canonical): skipped", name)
                out.skipped += 1
            continue
        seg, sb = parsed
        try:
            st = os.lstat(os.path.join(directory, name))
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode) or -(-st.st_size // sb) > MAX_SLAB_SLOTS:
            log.error("%s is not a regular file or holds more slots than any segment: skipped",
                      name)
            out.skipped += 1
            continue
        out.slabs.append((seg, sb, st.st_size))
    return out


def open_index(directory: str, slabs: slab.SlabFiles, *, capacity: int, segment_size: int,
               free_slot: Callable[[Freed], None], timeout_s: float,
               lease: Callable[[], str] | None = None,
               mine: str | None = None) -> tuple[Index, str | None]:
    """The directory's index, checked and recovered. Raises StoreError (lock deadline, a refused
    file, an index another process keeps locked, a rebuild refused while others use the
    directory) on the control path; the data path turns that into misses.

    `lease()` is called under the lock once the index is sound (the caller's lease is taken
    there, so an opener still waiting for the lock never keeps a rebuild from happening);
    `mine`: the caller's lease token if it holds one already (a reopen). Busy is not damage: an
    index another process holds SQLite's write lock on (a writer paused mid-transaction) is
    waited for until `timeout_s` has passed, then a StoreError, and never set aside."""
    path = os.path.join(directory, INDEX_NAME)
    deadline = time.monotonic() + timeout_s
    with cachedir.locked(os.path.join(directory, LOCK_NAME), timeout_s):
        pause = 0.01
        while True:
            try:
                return _open_locked(directory, slabs, path, capacity, segment_size, free_slot,
                                    deadline, lease, mine)
            except sqlite3.OperationalError as e:
                if not is_busy(e):
                    raise cachedir.control_error(OSError(0, str(e), path), "index file") \
                        from None
                if time.monotonic() >= deadline:
                    raise StoreError(
                        f"index {path!r} stayed locked by another process for {timeout_s:g} s "
                        f"(a writer paused or stopped in the middle of a transaction, e.g. by "
                        f"SIGSTOP or `docker pause`): not opened, nothing set aside. Resume or "
                        f"stop it (`fuser -v {path}` shows who has it open), then retry") from None
                log.info("index %s is locked by another process (%s): waiting", path, e)
                time.sleep(pause)
                pause = min(0.25, pause * 2)


class Opener:
    """One store's `open_index`, for `IndexAccess` (`open(timeout_s)`; called again after another
    process set the index aside and rebuilt it): it takes this process's lease at the first open
    (`owner`, the token of its slots; `close()` ends it) and keeps where a rebuild set the old
    index aside (`rebuilt_from`)."""

    def __init__(self, directory: str, slabs: slab.SlabFiles, capacity: int, segment_size: int):
        self.directory, self.slabs = directory, slabs
        self.capacity, self.segment_size = capacity, segment_size
        self.lease: Lease | None = None
        self.rebuilt_from: str | None = None

    @property
    def owner(self) -> str:
        return self.lease.token if self.lease is not None else ""

    def open(self, timeout_s: float) -> Index:
        index, aside = open_index(self.directory, self.slabs, capacity=self.capacity,
                                  segment_size=self.segment_size, free_slot=self._free_slot,
                                  timeout_s=timeout_s, lease=self._take_lease,
                                  mine=self.lease.token if self.lease else None)
        self.rebuilt_from = aside or self.rebuilt_from
        return index

    def _take_lease(self) -> str:
        if self.lease is None:
            self.lease = Lease(self.directory)
        return self.lease.token

    def _free_slot(self, f: Freed) -> None:
        self.slabs.free(f.seg, f.slot_bytes, f.slot)

    def close(self) -> None:
        if self.lease is not None:
            self.lease.close()   # its slots are given back (or left for a reclaim)


def _open_locked(directory: str, slabs: slab.SlabFiles, path: str, capacity: int,
                 segment_size: int, free_slot: Callable[[Freed], None], deadline: float,
                 lease: Callable[[], str] | None, mine: str | None) -> tuple[Index, str | None]:
    """One try of `open_index` under the directory lock (sqlite3 'database is locked': retried)."""
    aside = None
    index: Index | None = None
    try:
        found = scan_slabs(directory)
        why = _untrusted_file(path)
        if why and found.with_data():
            aside = _rebuild_alone(directory, slabs, path, segment_size, found, why, mine)
        else:
            why = ""
            try:
                index = _connect(path, deadline)
                index.check_and_init()
                unnamed = found.with_data() - index.segment_names()
                if unnamed:
                    why = (f"incomplete: {len(unnamed)} slab files with data are not in it "
                           f"(e.g. {slabs.path(*min(unnamed))})")
            except sqlite3.DatabaseError as e:
                if is_busy(e):
                    raise
                why = f"damaged: {e}"
            if why:
                if index is not None:
                    index.close()
                    index = None
                aside = _rebuild_alone(directory, slabs, path, segment_size, found, why, mine)
        if index is None:
            index = _connect(path, deadline)
            index.check_and_init()
        if lease is not None:
            index.owner = lease()   # the holder of the slots it frees until they are punched
        drop_missing_segments(index, slabs)
        index.reclaim_dead(free_slot)
        index.set_capacity(capacity)
    except OSError as e:
        if index is not None:
            index.close()
        raise cachedir.control_error(e, "index file") from None
    except BaseException:
        if index is not None:
            index.close()
        raise
    return index, aside


def _connect(path: str, deadline: float) -> Index:
    """The index, waiting for another connection's lock only until `deadline` (monotonic)."""
    index = Index(path)
    index.set_busy_timeout(max(0.05, deadline - time.monotonic()))
    return index


def _rebuild_alone(directory: str, slabs: slab.SlabFiles, path: str, segment_size: int,
                   found: Scan, why: str, mine: str | None) -> str | None:
    """`_rebuild`, only if no other process holds a lease on the directory: a live writer keeps
    committing into the index it has open, so a rebuild beside it would lose its blocks."""
    others = live_leases(directory, mine)
    if others:
        raise StoreError(
            f"index {path!r} is {why}, but {len(others)} other process(es) have this cache "
            f"directory open (lease files {', '.join(sorted(o.split(':', 1)[1][:8] for o in others))}"
            f"...): rebuilding it now would lose the blocks they are writing. Nothing was changed; "
            f"the first open after they have closed rebuilds it (their blocks are in the slab "
            f"files). Stop them or wait, then retry")
    return _rebuild(directory, slabs, path, segment_size, found, why)


def _untrusted_file(path: str) -> str:
    """Why the index file cannot be the directory's index whatever it holds ('' if it may be)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    return "empty (0 bytes)" if stat.S_ISREG(st.st_mode) and st.st_size == 0 else ""


def drop_missing_segments(index: Index, slabs: slab.SlabFiles) -> int:
    """Drop segments whose slab file is gone (a power cut before its name was durable, a manual
    delete) or is anything but a regular file. Returns how many blocks were dropped."""
    dropped = 0
    for seg, sb in index.live_segments():
        try:
            st = os.lstat(slabs.path(seg, sb))
            why = "" if stat.S_ISREG(st.st_mode) else "not a regular file (refused)"
        except FileNotFoundError:
            why = "missing"
        if why:
            gone = index.drop_segment(seg)
            slabs.forget(seg, sb)
            dropped += len(gone)
            log.error("slab %s is %s: its %d blocks are dropped", slabs.path(seg, sb), why,
                      len(gone))
    return dropped


def _remove(path: str) -> None:
    for suffix in ("", *SIDE_FILES):
        try:
            os.unlink(path + suffix)
        except FileNotFoundError:
            pass


def _old_tombstones(path: str) -> set[tuple[int, int, int]]:
    """(slot_bytes, seg, slot) the old index kept as tombstones, where it can still be read."""
    if not os.path.exists(path):
        return set()
    try:
        rows = read_only(path, "SELECT slot_bytes, seg, slot FROM tombstones", timeout=0.1)
    except sqlite3.Error:
        return set()
    return {r for r in rows if all(type(v) is int for v in r)}


def _rebuild(directory: str, slabs: slab.SlabFiles, path: str, segment_size: int, found: Scan,
             why: str) -> str | None:
    """Build a complete index from the slab headers aside, then rename it into place. Returns
    where the old index was set aside (None if there was none)."""
    log.error("index %s is %s: rebuilding it from the slab headers", path, why)
    tmp = path + REBUILD_SUFFIX
    step("start")
    _remove(tmp)                      # a killed rebuild's leftovers: built again from scratch
    index = Index(tmp)
    try:
        index.check_and_init()
        step("created")
        rows, segments, free, tombs = _recover(slabs, found, segment_size,
                                               _old_tombstones(path))
        index.insert_recovered(rows, segments, free, tombs)
        step("filled")
        index.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        index.close()
    fd = cachedir.open_file(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    step("synced")
    aside = None
    if os.path.lexists(path):
        aside = f"{path}.{why.split(':')[0].split(' ')[0]}-{time.time_ns()}"
        for suffix in ("", *SIDE_FILES):
            if os.path.lexists(path + suffix):
                os.replace(path + suffix, aside + suffix)
        log.error("the old index is set aside as %s", aside)
    else:
        _remove(path)                 # a WAL left without its database belongs to no index
    step("set aside")
    for suffix in SIDE_FILES:
        if os.path.lexists(tmp + suffix):
            os.unlink(tmp + suffix)
    os.replace(tmp, path)
    step("renamed")
    cachedir.fsync_dir(directory)
    log.warning("rebuilt the index of %s: %d blocks recovered (each verified on read), %d slab "
                "files and names skipped", directory, len(rows), found.skipped)
    return aside


Row = tuple[bytes, int, int, int, int, int, float]


def _recover(slabs: slab.SlabFiles, found: Scan, segment_size: int, tombstoned: set[SlotAddr]
             ) -> tuple[list[Row], list[tuple[int, int, int, int]], list[SlotAddr], list[SlotAddr]]:
    """Rows, segments, free slots and tombstones of a new index, from the slab headers."""
    rows: list[Row] = []
    segments, free, tombs = [], [], []
    seen: set[bytes] = set()
    skipped = 0
    for seg, sb, size in found.slabs:
        used = -(-size // sb)
        try:
            allocated = slabs.allocated_slots(seg, sb, used)
        except OSError as e:
            log.error("%s: %s: skipped", slabs.path(seg, sb), e)
            found.skipped += 1
            continue
        segments.append((seg, sb, max(used, segment_size // sb), used))
        free += [(sb, seg, s) for s in range(used) if s not in allocated]
        for s in sorted(allocated):
            def good(h: slot_format.Header | None) -> bool:
                return (h is not None and h.key not in seen and h.length <= MAX_LENGTH
                        and slot_format.slot_bytes_for(h.length) == sb
                        and (sb, seg, s) not in tombstoned)
            h = slabs.read_header(seg, sb, s)
            if not good(h):   # bad only after a re-read, as every reader decides (`drop_bad`)
                try:
                    h = slabs.read_header(seg, sb, s, errors=True)
                except OSError as e:   # no proof either way: neither recovered nor freed
                    log.error("%s slot %d unreadable (%s): left as it is", slabs.path(seg, sb),
                              s, e)
                    found.skipped += 1
                    continue
            ok = good(h)
            if h is None or not ok:
                skipped += h is not None
                try:
                    slabs.free(seg, sb, s)
                    free.append((sb, seg, s))
                except OSError:
                    tombs.append((sb, seg, s))
                continue
            seen.add(h.key)
            rows.append((h.key, seg, s, sb, h.length, h.csum, h.created_ns / 1e9))
    if skipped:
        log.error("%d slot headers named a block twice, a deleted block or a length outside "
                  "their slot: not recovered", skipped)
    found.skipped += skipped
    return rows, segments, free, tombs


__all__ = ["INDEX_NAME", "LOCK_NAME", "REBUILD_SUFFIX", "Opener", "Scan", "drop_missing_segments",
           "open_index", "parse_slab_name", "scan_slabs", "step"]
