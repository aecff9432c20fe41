"""SGLang's v2 (pool) calls: `PoolPages`, a part of `OffloadStorage`.

- `exists_v2(keys, transfers)`: `batch_exists_v2`: the KV hits (`KvPages.hits`), each sidecar's
  presence under the same keys, SGLang's hit policies (`pools.restorable`), then the worth-it
  rule over the KV page plus every sidecar loaded with it (`worth_cut`).
- `get_v2(transfers)` / `set_v2(transfers)`: `batch_get_v2` / `batch_set_v2`: each transfer's
  pool moved by `page_io.move` (KV through `KvPages.move`), recorded per pool.

A pool SGLang names that is not registered (or was refused at run time) is a miss for each of its
pages. The miss values SGLang gets when a call fails (`empty_result`, `all_false_v2`) live here;
the face guards the calls with them (`never_raises`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence

from offload.hicache import page_io
from offload.hicache.kv import KvPages
from offload.hicache.pools import KV, pool_str, restorable
from offload.hicache.recorder import Recorder
from offload.hicache.state import BackendState

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer, PoolTransferResult

logger = logging.getLogger(__name__)


def empty_result(*_: Any, **__: Any) -> "PoolTransferResult":
    """`batch_exists_v2`'s miss: nothing restorable."""
    from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

    return PoolTransferResult(0, {}, [])


def all_false_v2(_self: Any, transfers: Sequence[Any], *_: Any, **__: Any
                 ) -> dict[Any, list[bool]]:
    """`batch_get_v2` / `batch_set_v2`'s miss: every page of every transfer."""
    return {t.name: [False] * len(t.keys or []) for t in transfers}


class PoolPages:
    def __init__(self, st: BackendState, kv: KvPages, rec: Recorder):
        self.st, self.kv, self.rec = st, kv, rec

    def exists_v2(self, keys: list[str], transfers: Sequence["PoolTransfer"]
                  ) -> "PoolTransferResult":
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        st = self.st
        if st.logical_anchor:
            kv_pages = len(keys) if transfers else 0   # the sidecars carry every byte
        else:
            kv_pages = self.kv.hits(keys)
        present: dict[str, list[bool]] = {}
        for t in transfers:
            pool = st.pools.get(pool_str(t.name))
            if pool is None:
                present[pool_str(t.name)] = [False] * kv_pages
            elif pool_str(t.name) not in present:
                present[pool_str(t.name)] = st.store.exists_many(pool.keys(keys[:kv_pages]))
        rest, hits = restorable(kv_pages, transfers, present)
        if kv_pages:
            hits = {KV: kv_pages, **hits}   # the first key is SGLang's PoolName.KV (equal str)
        final = rest[-1] if rest else 0
        cut = self.worth_cut(final, transfers)
        if cut < final:
            rest = [p for p in rest if p <= cut]
            final = rest[-1] if rest else 0
        return PoolTransferResult(final, hits, rest)

    def worth_cut(self, final: int, transfers: Sequence[Any]) -> int:
        """The worth-it rule over the KV page plus every sidecar loaded with it."""
        st = self.st
        kv_pages = st.kv.pages if st.kv is not None else None
        if final == 0 or kv_pages is None:
            return final
        nbytes = kv_pages.page_bytes + sum(
            p.page_bytes for p in (st.pools.get(pool_str(t.name)) for t in transfers)
            if p is not None)
        return self.kv.worth_loading(final, nbytes)

    def move_v2(self, transfers: Sequence["PoolTransfer"], write: bool) -> dict[Any, list[bool]]:
        return {t.name: self._one(t, write) for t in transfers}

    def _one(self, t: "PoolTransfer", write: bool) -> list[bool]:
        keys = list(t.keys or [])
        name = pool_str(t.name)
        if name == KV:
            return self.kv.move(keys, t.host_indices, write)
        pool = self.st.pools.get(name)
        if pool is None:
            if keys:
                logger.debug("offload: %s of unregistered pool %s", "set" if write else "get", name)
            return [False] * len(keys)
        return self.rec.moved(pool, write, len(keys),
                              page_io.move(self.st.store, pool, keys, t.host_indices, write))
