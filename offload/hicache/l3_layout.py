"""SGLang's L3 object-layout handshake for `OffloadStorage`: what an outside reader needs to find
a page's blocks without asking the engine.

`describe(st, sidecar_pool_specs, swa_trailing_pages, page_size)` (`st`: the backend's
`BackendState`) returns SGLang's envelope
(`enabled`, `backend`, `page_size`, `hicache_object_layout`, else a `reason`), the shape
`merge_l3_layouts` joins across schedulers. Per pool: its hit policy (and trailing window) and
the namespace digests of its objects, hex, for EVERY rank of the model, not only this one, so
every TP rank returns the same layout (SGLang's Mooncake backend cannot enumerate other ranks'
suffixes and reports MHA layouts as disabled). A page's block key is
`namespace digest (16 bytes) + blake2b(page hash, digest_size=16, person=b"sglo-page-v1")`
(`offload.keys`). The layout names no path, address or salt (a salted namespace differs only in
its digest). Attention-CP and DCP shards are not enumerated yet: reported as disabled.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from offload.hicache.keying import kv_plan
from offload.hicache.pools import KV, MAMBA, build_pool, pool_str
from offload.hicache.state import BackendState

KEY_SCHEME = "offload-blake2b-v1"


def _disabled(reason: str, page_size: int | None) -> dict:
    return {"enabled": False, "backend": "offload", "page_size": page_size,
            "hicache_object_layout": {"pools": []}, "reason": reason}


def describe(st: BackendState, sidecar_pool_specs: Sequence[Any],
             swa_trailing_pages: int | None, page_size: int | None) -> dict:
    """The L3 layout of an attached backend's state; see the module docstring."""
    sc = st.storage_config
    if st.namespace is None:
        return _disabled("The offload host pool is not registered", page_size)
    if sc.attn_cp_size > 1 or sc.dcp_size > 1:
        return _disabled("Context-parallel shards are not enumerated by the offload layout",
                         page_size)
    ranks = [replace(sc, tp_rank=r) for r in range(sc.tp_size)]
    # Rank r's KV plan: MLA (and an anchor without pages) is one namespace for every rank.
    kv = st.kv
    pages = kv.pages if kv is not None else None
    plan = kv.plan if kv is not None else None
    plans = [plan if sc.is_mla_model or pages is None else kv_plan(
        rank, st.host, pages, st.cfg.store.salt) for rank in ranks]
    pools: list[dict] = []
    if plan is not None:
        digests = [d for p in plans if p is not None for d in p.digests]
        pools.append({"pool": KV, "hit_policy": "all_pages",
                      "namespaces": _unique_hex(digests)})
    specs = {pool_str(s.pool_name): s for s in sidecar_pool_specs}
    trailing = {MAMBA: 1, "swa": swa_trailing_pages}
    for name, pool in st.pools.items():
        spec = specs.get(name)
        policy = pool_str(spec.hit_policy) if spec is not None else (
            "trailing_pages" if name in trailing else "all_pages")
        digests = [build_pool(name, pool.host, p.namespaces[0] if p is not None else
                              st.namespace, rank, st.is_writer)[0].digest
                   for rank, p in zip(ranks, plans)]
        entry: dict[str, Any] = {"pool": name, "hit_policy": policy,
                                 "namespaces": _unique_hex(digests)}
        if policy == "trailing_pages":
            source = pool_str(spec.indices_from_pool) if spec is not None and getattr(
                spec, "indices_from_pool", None) is not None else name
            window = trailing.get(source)
            if not window or window <= 0:
                return _disabled(f"Unknown or non-positive trailing-page window for pool {name}",
                                 page_size)
            entry["trailing_pages"] = window
        pools.append(entry)
    if not pools:
        return _disabled("No physical L3 pools are registered", page_size)
    return {"enabled": True, "backend": "offload", "page_size": page_size,
            "hicache_object_layout": {
                "pools": pools, "key_scheme": KEY_SCHEME, "is_mla_backend": bool(sc.is_mla_model),
                "tp_size": sc.tp_size, "pp_rank": sc.pp_rank, "pp_size": sc.pp_size}}


def _unique_hex(digests: Sequence[bytes]) -> list[str]:
    """In rank / head-group order, a shared namespace listed once."""
    return list(dict.fromkeys(d.hex() for d in digests))
