"""Opening a cache directory's index, with recovery: what `DiskStore` does under the directory lock.

`open_index(directory, slabs, ...)`: under the lock file (taken with a deadline), open the index and
`PRAGMA quick_check` it; a missing index beside slab files is rebuilt from their headers; a
damaged index is set aside (`index.db.damaged-<time>`, renames fsync'ed)
and rebuilt from the slab headers (a freed slot's header never names a block, so nothing deleted
comes back); a segment whose slab file is missing or is not a regular file is dropped (its blocks
stop existing, its slots are never handed out again); dead processes' pending slots are reclaimed.
Returns the index and where a damaged one was set aside (None if it was sound).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import time
from typing import Callable

from offload.store import cachedir, slab, slot_format
from offload.store.index import SIDE_FILES, Freed, Index

log = logging.getLogger(__name__)

INDEX_NAME = "index.db"
LOCK_NAME = "lock"


def open_index(directory: str, slabs: slab.SlabFiles, *, capacity: int, segment_size: int,
               free_slot: Callable[[Freed], None], timeout_s: float) -> tuple[Index, str | None]:
    """The directory's index, checked and recovered. Raises StoreError (lock deadline, a refused
    file) on the control path; the data path turns that into misses."""
    path = os.path.join(directory, INDEX_NAME)
    with cachedir.locked(os.path.join(directory, LOCK_NAME), timeout_s):
        rebuilt_from = None
        index: Index | None = None
        try:
            try:
                if not os.path.lexists(path) and _has_slabs(directory):
                    log.error("index %s is missing beside slab files: rebuilding it from the slab "
                              "headers", path)
                    index = _rebuild(directory, slabs, path, segment_size)
                else:
                    index = Index(path)
                    index.check_and_init()
            except sqlite3.DatabaseError as e:
                if index is not None:
                    index.close()
                rebuilt_from = f"{path}.damaged-{int(time.time())}"
                index = _set_aside_and_rebuild(directory, slabs, path, rebuilt_from, str(e),
                                               segment_size)
            drop_missing_segments(index, slabs)
            index.reclaim_dead(free_slot)
            index.set_capacity(capacity)
        except OSError as e:
            if index is not None:
                index.close()
            raise cachedir.control_error(e, "index file") from None
        return index, rebuilt_from


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


def _set_aside_and_rebuild(directory: str, slabs: slab.SlabFiles, path: str, aside: str, why: str,
                           segment_size: int) -> Index:
    log.error("index %s is damaged (%s): set aside as %s, rebuilding from the slab headers",
              path, why, aside)
    for suffix in ("", *SIDE_FILES):
        if os.path.lexists(path + suffix):
            os.replace(path + suffix, aside + suffix)
    cachedir.fsync_dir(directory)
    return _rebuild(directory, slabs, path, segment_size)


def _has_slabs(directory: str) -> bool:
    return any(slot_format.parse_segment_name(n) is not None for n in os.listdir(directory))


def _rebuild(directory: str, slabs: slab.SlabFiles, path: str, segment_size: int) -> Index:
    """A new index at `path` holding every block whose slab header names it."""
    for suffix in SIDE_FILES:            # a WAL left without its database belongs to no index
        if os.path.lexists(path + suffix):
            os.unlink(path + suffix)
    index = Index(path)
    index.check_and_init()
    rows, segments, free = [], [], []
    seen: set[bytes] = set()
    for name in sorted(os.listdir(directory)):
        parsed = slot_format.parse_segment_name(name)
        if parsed is None:
            continue
        seg, sb = parsed
        st = os.lstat(os.path.join(directory, name))
        if not stat.S_ISREG(st.st_mode):
            log.error("%s is not a regular file: not rebuilt", name)
            continue
        used = -(-st.st_size // sb)
        segments.append((seg, sb, max(used, segment_size // sb), used))
        allocated = slabs.allocated_slots(seg, sb, used)
        free += [(sb, seg, s) for s in range(used) if s not in allocated]
        for s in sorted(allocated):
            h = slabs.read_header(seg, sb, s)
            if h is None or h.key in seen or slot_format.slot_bytes_for(h.length) != sb:
                free.append((sb, seg, s))
                slabs.free(seg, sb, s)
                continue
            seen.add(h.key)
            rows.append((h.key, seg, s, sb, h.length, h.csum, h.created_ns / 1e9))
    index.insert_recovered(rows, segments, free)
    log.warning("rebuilt the index of %s: %d blocks recovered (each verified on read)",
                directory, len(rows))
    return index


__all__ = ["INDEX_NAME", "LOCK_NAME", "drop_missing_segments", "open_index"]
