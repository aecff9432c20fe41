"""A backend attached to one family's real SGLang host pools, and pages written through it the way
SGLang's controllers do (v1 for KV, `batch_set_v2` for the sidecars): `attach`, `transfers`,
`write`. The v2 pool tests and the parity tests share them."""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolTransfer as PT

from tests.hicache import hicache_pools as hp
from tests.hicache import pool_families as pf


def attach(family: str, sc_extra: dict, *, layout: str = "page_first", **sc: Any
            ) -> tuple[Any, Any, dict]:
    anchor, pools = pf.build(family, layout)
    mla = family == "indexer" or sc.pop("mla", False)
    cfg = hp.storage_config(sc_extra, mla=mla, layout=layout, **sc)
    backend = hp.make_backend(cfg, anchor)
    for name, (pool, *_rest) in pools.items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend, anchor, pools


def transfers(pools: dict, keys: list[str], first_page: int, *, query: bool = False
               ) -> list[Any]:
    """The PoolTransfers SGLang builds: KV-derived sidecars reuse the KV page indices;
    TRAILING_PAGES pools carry the last `trailing` keys in their own slots."""
    out = []
    for name, (pool, policy, from_pool, trailing) in pools.items():
        ks = keys[-trailing:] if trailing else keys
        if query:
            out.append(PT(name=name, keys=ks, hit_policy=policy, indices_from_pool=from_pool))
            continue
        ps = pool.page_size
        start = (first_page if from_pool is not None else first_page % 8) * ps
        idx = torch.arange(start, start + len(ks) * ps)
        out.append(PT(name=name, host_indices=idx, keys=ks, hit_policy=policy,
                      indices_from_pool=from_pool))
    return out


def write(backend: Any, anchor: Any, pools: dict, keys: list[str], first_page: int = 0) -> None:
    P = anchor.page_size
    if getattr(anchor, "kv_buffer", None) is not None:
        pf.fill_any(anchor, 5)
        idx = torch.arange(first_page * P, (first_page + len(keys)) * P)
        assert backend.batch_set_v1(keys, idx) == [True] * len(keys)
    for pool, *_ in pools.values():
        pf.fill_any(pool, 7)
    res = backend.batch_set_v2(transfers(pools, keys, first_page))
    for t in transfers(pools, keys, first_page):
        assert res[t.name] == [True] * len(t.keys), t.name
