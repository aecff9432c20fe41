"""SGLang's host pools attached to the backend: `Attach`, a part of `OffloadStorage` (control path).

- `kv(host_pool)`: `register_mem_pool_host`. A layout we cannot map is refused (`ConfigError`);
  SGLang's page-hash extension is built or loaded (`native_hash`: no request pays it). Then one of
  three: an allocator-only MLA pool (host dedup's non-source ranks: the KV `Pool` has no pages and
  reports the blocks the source rank stores); DeepSeek-V4's logical anchor (no KV bytes: only the
  namespace, the v2 pools hold the pages); or a KV `Pool` over the host pool's `PageMap` and key
  plan (`keying`), its namespaces registered with the store, its L3 KV events opened, its memory
  registered with a store that moves pages itself (`RegistersRegions`, found on the store graph
  by `store.base.find`: the dpu path's NIXL).
- `sidecar(host_pool, name)`: `register_mem_host_pool_v2`: a sidecar `Pool` (`pools.build_pool`):
  at attach a refusal fails the attach; after `done()` (SGLang's `on_host_pools_registered`) a
  refused pool is logged and every call for it is a miss.
"""

from __future__ import annotations

import logging
from typing import Any

from offload.errors import ConfigError
from offload.hicache.events import kv_events_for
from offload.hicache.keying import (
    allocator_only_mla,
    kv_plan,
    namespace_for,
    refuse_layout,
    replica_plan,
)
from offload.hicache.layout import PageMap
from offload.hicache.native_hash import ensure_native_hash
from offload.hicache.pools import KV, MAMBA, build_pool, family_of, kv_pool
from offload.hicache.state import BackendState
from offload.store.base import RegistersRegions, find

logger = logging.getLogger(__name__)


def _register_region(st: BackendState, buffer: Any) -> None:
    """Memory pages move through, for a store that moves them itself (the agent by NIXL): told
    to the outermost store on the store graph that registers regions (a tiered store or a
    transfer path passes it on to its own parts)."""
    for store in find(st.store, RegistersRegions)[:1]:
        store.register_region(buffer)


class Attach:
    def __init__(self, st: BackendState):
        self.st = st

    def kv(self, host_pool: Any) -> None:
        st, sc, salt = self.st, self.st.storage_config, self.st.cfg.store.salt
        st.host = host_pool
        refused = refuse_layout(host_pool)
        if refused is not None:
            raise refused
        ensure_native_hash()   # SGLang's page hashes: built / loaded now, not by the first request
        if allocator_only_mla(host_pool):   # MLA host dedup: rank 0 holds the bytes
            plan = replica_plan(sc, host_pool, salt)
            st.namespace = plan.namespaces[0]
            st.store.register_namespace(st.namespace)
            st.kv = kv_pool(host_pool, None, plan, is_writer=False)
            logger.info("offload: allocator-only MLA host pool (host dedup): this rank reports "
                        "the blocks the source rank stores, and moves no bytes")
            return
        # SGLang's host pool, probed by its own attribute: DeepSeek-V4's anchor has no buffer
        st.logical_anchor = getattr(host_pool, "kv_buffer", True) is None
        if st.logical_anchor:  # DeepSeek-V4: the anchor owns indices, the v2 pools the bytes
            st.namespace = namespace_for(sc, host_pool, 0, salt)
            logger.info("offload: logical KV anchor (%s): pages live in the v2 pools",
                        type(host_pool).__name__)
            return
        pages = PageMap.for_pool(host_pool)
        plan = kv_plan(sc, host_pool, pages, salt)
        st.namespace = plan.namespaces[0]
        for ns in plan.namespaces:
            st.store.register_namespace(ns)
        st.kv = kv_pool(host_pool, pages, plan, st.is_writer)
        st.events = kv_events_for(st, int(host_pool.page_size))
        _register_region(st, host_pool.kv_buffer)   # dpu: the agent moves pages in and out of it
        logger.info("offload: HiCache backend on %s, layout %s, %d-byte pages in %d buffer(s), "
                    "%d object(s) per page, zero copy %s, writer %s",
                    ", ".join(st.cfg.store.directories()), pages.layout, pages.page_bytes,
                    max(1, pages.buffers_per_page), plan.split, pages.zero_copy, st.is_writer)

    def sidecar(self, host_pool: Any, name: str) -> None:
        st = self.st
        if name == KV or host_pool is st.host:
            return   # the anchor: v1 pages (`kv`)
        try:
            if st.namespace is None:
                raise ConfigError([f"offload: pool {name!r} registered before the KV host pool"])
            pool, ns = build_pool(name, host_pool, st.namespace, st.storage_config, st.is_writer)
        except ConfigError as e:
            if not st.attached:
                raise
            logger.error("offload: pool %s registered at run time is not stored (every call "
                         "for it is a miss): %s", name, e)
            return
        st.store.register_namespace(ns)
        if pool.pages is not None and pool.pages.zero_copy:
            _register_region(st, host_pool.kv_buffer)
        st.pools[name] = pool
        logger.info("offload: pool %s (%s, %s): %d-byte pages of %d tokens, %s, written by %s",
                    name, type(host_pool).__name__, family_of(name), pool.page_bytes,
                    pool.page_size, "per TP rank" if ns.tp_size > 1 or name == MAMBA else "shared",
                    "this rank" if pool.writes else "the MLA writer rank")

    def done(self) -> None:
        self.st.attached = True
        logger.info("offload: host pools registered: %s", ", ".join(self.st.pools) or "KV only")
