"""DiskStore's control path and maintenance (`sglang-offload cache`), mixed into `DiskStore`.

Primitives (`DiskAdmin`): `register_namespace`, `clear`, `evict_to` (index writes that may wait
up to `LOCK_TIMEOUT_S` for another process, then raise `StoreError`), `summary` (`cache stats`)
and `verify` (`cache verify`: re-read every committed block through `scrub.scan`).
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor
from typing import Any, Callable

from offload.errors import StoreError
from offload.keys import NS_BYTES, Namespace
from offload.store.base import StoreStats
from offload.store.disk import scrub
from offload.store.disk.commit import Committer
from offload.store.disk.index.access import BUSY, LOCK_TIMEOUT_S, IndexAccess
from offload.store.disk.index.db import Freed, Location
from offload.store.disk.slab import files as slab
from offload.store.disk.slab.format import ReadOutcome


class DiskAdmin:
    # provided by DiskStore
    _ix: IndexAccess
    _lock: threading.RLock
    _keys: set[bytes]
    _seq: int
    _slabs: slab.SlabFiles
    _pool: Executor
    _stats: StoreStats
    _commits: Committer

    def _free_slot(self, f: Freed) -> None:
        raise NotImplementedError

    def _refresh_keys(self) -> bool:
        raise NotImplementedError

    def register_namespace(self, ns: Namespace) -> None:
        self._ix.write(lambda index: index.record_namespace(ns.digest(), ns.describe()),
                       control=True)

    def clear(self, namespace: bytes | None = None) -> int:
        """Delete every block, or every block of one namespace digest (16 bytes)."""
        if namespace is not None and len(namespace) != NS_BYTES:
            raise StoreError(f"namespace digest must be {NS_BYTES} bytes")
        self._commits.settle(LOCK_TIMEOUT_S)
        with self._lock:
            self._refresh_keys()
            keys = [k for k in self._keys if namespace is None or k[:NS_BYTES] == namespace]
        n = self._ix.write(lambda index: index.delete(keys, self._free_slot), control=True)
        with self._lock:
            self._keys.difference_update(keys)
        return 0 if n is BUSY else int(n)  # type: ignore[arg-type]

    def evict_to(self, used_bytes: int) -> int:
        """Evict least-recently-used blocks until at most `used_bytes` are used."""
        self._commits.settle(LOCK_TIMEOUT_S)
        n = self._ix.write(lambda index: index.evict_to(used_bytes, self._free_slot), control=True)
        with self._lock:
            self._seq = -1  # reload the key set on next use
            self._refresh_keys()
        return 0 if n is BUSY else int(n)  # type: ignore[arg-type]

    def summary(self) -> dict[str, Any]:
        """Blocks, bytes and age per namespace (with descriptions): `cache stats`."""
        self._commits.settle(LOCK_TIMEOUT_S)
        with self._lock:
            return self._ix.reader.summary()

    def verify(self, progress: Callable[[int], None] | None = None,
               batch: int = 64) -> tuple[int, list[tuple[bytes, ReadOutcome]]]:
        """Re-read every committed block and check header and checksum; corrupt ones are deleted.

        Safe while other processes use the directory: a block deleted or evicted meanwhile is
        not counted as bad. `progress(n)` is called after each batch of n blocks.
        Returns (blocks checked, [(key, outcome)] of the bad ones: corrupt ones were deleted,
        failed ones (an I/O error) kept).
        """
        def drop(loc: Location, corrupt: bool) -> bool:
            if corrupt:
                still = self._ix.write(lambda index: index.drop_corrupt([loc], self._free_slot),
                                       control=True)
                gone = still if isinstance(still, list) else []
                with self._lock:
                    self._keys.difference_update(gone)
                    self._stats.checksum_failures += len(gone)
                return bool(gone)
            with self._lock:
                return bool(self._ix.reader.locate([loc.key]))

        def page(after: bytes) -> list[Location]:
            with self._lock:
                return self._ix.reader.committed_after(after, batch)

        return scrub.scan(self._slabs, self._pool, page, drop, progress)


__all__ = ["DiskAdmin"]
