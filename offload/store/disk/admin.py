"""A disk store's control path and maintenance (`sglang-offload cache`), behind `DiskStore`'s.

Primitives (`Admin(state, commits)`): `register_namespace`, `clear`, `evict_to` (index writes that may wait
up to `LOCK_TIMEOUT_S` for another process, then raise `StoreError`), `summary` (`cache stats`)
and `verify` (`cache verify`: re-read every committed block through `scrub.scan`).
"""

from __future__ import annotations

from typing import Any, Callable

from offload.errors import StoreError
from offload.keys import NS_BYTES, Namespace
from offload.store.disk import scrub
from offload.store.disk.commit import Committer
from offload.store.disk.index.access import LOCK_TIMEOUT_S, Busy
from offload.store.disk.index.db import Location
from offload.store.disk.slab.format import ReadOutcome
from offload.store.disk.state import DiskState


class Admin:
    def __init__(self, state: DiskState, commits: Committer):
        self.state, self.commits = state, commits

    def register_namespace(self, ns: Namespace) -> None:
        st = self.state
        st.ix.write(lambda index: index.record_namespace(ns.digest(), ns.describe()), control=True)

    def clear(self, namespace: bytes | None = None) -> int:
        """Delete every block, or every block of one namespace digest (16 bytes)."""
        st = self.state
        if namespace is not None and len(namespace) != NS_BYTES:
            raise StoreError(f"namespace digest must be {NS_BYTES} bytes")
        self.commits.settle(LOCK_TIMEOUT_S)
        with st.lock:
            st.refresh_keys()
            keys = [k for k in st.keys if namespace is None or k[:NS_BYTES] == namespace]
        n = st.ix.write(lambda index: index.delete(keys, st.free_slot), control=True)
        with st.lock:
            st.keys.difference_update(keys)
        return 0 if isinstance(n, Busy) else n

    def evict_to(self, used_bytes: int) -> int:
        """Evict least-recently-used blocks until at most `used_bytes` are used."""
        st = self.state
        self.commits.settle(LOCK_TIMEOUT_S)
        n = st.ix.write(lambda index: index.evict_to(used_bytes, st.free_slot), control=True)
        with st.lock:
            st.seq = -1  # reload the key set on next use
            st.refresh_keys()
        return 0 if isinstance(n, Busy) else n

    def summary(self) -> dict[str, Any]:
        """Blocks, bytes and age per namespace (with descriptions): `cache stats`."""
        st = self.state
        self.commits.settle(LOCK_TIMEOUT_S)
        with st.lock:
            return st.ix.reader.summary()

    def verify(self, progress: Callable[[int], None] | None = None,
               batch: int = 64) -> tuple[int, list[tuple[bytes, ReadOutcome]]]:
        """Re-read every committed block and check header and checksum; corrupt ones are deleted.

        Safe while other processes use the directory: a block is bad (and deleted) only if the
        index still holds the row that was read and a re-read of its slot under the write lock
        still fails (`DiskState.drop_bad`, as `get` does); a block deleted, evicted or rewritten
        meanwhile is not counted as bad. `progress(n)` is called after each batch of n blocks.
        Returns (blocks checked, [(key, outcome)] of the bad ones: corrupt ones were deleted,
        failed ones (an I/O error) kept).
        """
        st = self.state

        def drop(loc: Location, corrupt: bool) -> bool:
            if corrupt:   # the data path's rule: still held as read, still bad on a re-read
                still = st.ix.write(lambda index: st.drop_bad(index, [loc]), control=True)
                return bool(still if isinstance(still, list) else [])
            with st.lock:
                return bool(st.ix.reader.locate([loc.key]))

        def page(after: bytes) -> list[Location]:
            with st.lock:
                return st.ix.reader.committed_after(after, batch)

        return scrub.scan(st.slabs, st.pool, page, drop, progress)


__all__ = ["Admin"]
