"""The one place a local store is built: the disk store of a config, of an existing cache directory
(its recorded capacity kept), or the DRAM tier.

Primitives: `open_disk(StoreConfig)` -> `DiskStore` (one directory) or `SpreadStore` (the drives of
`offload.store.paths`: `offload/store/disk/spread/`); `open_existing(directory)` -> `DiskStore` with
the capacity recorded in its index (`cache` commands, `launch`'s store usage); `stored_capacity(dir)`;
`open_memory(capacity, reserve)` -> `MemoryStore`. The tiers are imported on call (no native module
and no SQLite connection at import). Errors: `UsageError` for a path that is not a cache directory,
`StoreError` for an index that cannot be read.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sqlite3
from typing import TYPE_CHECKING

from offload.config import Size, StoreConfig, format_size
from offload.errors import StoreError, UsageError

if TYPE_CHECKING:
    from offload.store.disk.spread import SpreadStore
    from offload.store.disk.store import DiskStore
    from offload.store.memory.store import MemoryStore

log = logging.getLogger(__name__)

INDEX = "index.db"


def open_disk(cfg: StoreConfig) -> DiskStore | SpreadStore:
    """The local store of a config: one directory's `DiskStore`, or one `SpreadStore` over the
    directories of `paths` when it names several."""
    dirs = cfg.directories()
    if len(dirs) > 1:
        from offload.store.disk.spread import SpreadStore

        return SpreadStore(cfg)
    from offload.store.disk.store import DiskStore

    return DiskStore(dataclasses.replace(cfg, path=dirs[0], paths=()))


def stored_capacity(directory: str) -> int:
    """The capacity cap recorded in the directory's index (kept when a command opens it)."""
    path = os.path.join(directory, INDEX)
    if not os.path.isdir(directory):
        raise UsageError(f"{directory}: not a cache directory (no such directory)")
    if not os.path.isfile(path):
        raise UsageError(f"{directory}: not a cache directory (no {INDEX}; the directory named by "
                         "offload.store.path)")
    from offload.store.disk.index.schema import read_only

    try:
        rows = read_only(path, "SELECT value FROM meta WHERE name='capacity'", timeout=30)
    except sqlite3.Error as e:
        raise StoreError(f"{path}: cannot read the index: {e}") from None
    cap = rows[0][0] if rows else 0
    return cap if type(cap) is int and cap >= 0 else 0   # damaged: the open rebuilds the index


def open_existing(directory: str) -> DiskStore:
    """An existing cache directory's store, with the capacity its index records."""
    cap = stored_capacity(directory)
    log.debug("opening %s (capacity %s read from %s)", directory, format_size(cap),
              os.path.join(directory, INDEX))
    from offload.store.disk.store import DiskStore

    return DiskStore(StoreConfig(path=directory, capacity=Size(cap), min_free=Size(0)))


def open_memory(capacity: int, reserve: int = 0) -> MemoryStore:
    from offload.store.memory.store import MemoryStore

    return MemoryStore(capacity=capacity, reserve=reserve)
