"""`bench hicache --family F`: KV plus one model family's sidecar pool, ours beside SGLang's `file`.

Primitives: `build_family(family, pages, layout)` -> (KV host pool, sidecar name, sidecar host
pool, hit policy, trailing) built from SGLang 0.5.23's own classes on CPU; `bench_family(root,
family, pages, layout, threads)` -> the figures. Both backends make the same calls SGLang's
hybrid controller makes: KV pages (ours `batch_set_v1` / `batch_get_v1`, the file backend's
v2 KV path) and the sidecar through `batch_set_v2` / `batch_get_v2`, in `STORAGE_BATCH_SIZE`
batches; an ALL_PAGES pool (draft, indexer) has a page per KV page, a TRAILING_PAGES pool
(mamba: 1 page, swa: 2) its window at the end of each batch. Writes are durable for both (the
file backend's files and directory are fsynced), reads cold (page cache dropped). Every page
read is checked against the one written, outside the timings.

Families: mha (KV only), draft (1-layer MHA draft), indexer (DSA indexer beside MLA KV), mamba
(Mamba state, 1 slot per trailing page), swa (SWA window pool, 2 trailing pages).
"""

from __future__ import annotations

import os
from typing import Any

from offload.bench.common import drop_cache, fsync_files, timed
from offload.bench.hicache import ours_extra

FAMILIES = ("mha", "draft", "indexer", "mamba", "swa")
TOKENS, LAYERS = 64, 32


def _mha(pages: int, layout: str, layers: int, heads: int = 8) -> Any:
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    kv = MHATokenToKVPool(2 * TOKENS, TOKENS, torch.bfloat16, head_num=heads, head_dim=128,
                          layer_num=layers, device="cpu", enable_memory_saver=False,
                          start_layer=0, end_layer=layers - 1)
    return MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 1.0, 0, TOKENS, layout,
                                pin_memory=False, device="cpu", device_capacity_tokens=kv.size,
                                start_layer=0, end_layer=layers - 1,
                                host_token_capacity=pages * TOKENS)


def _dsa(pages: int, layout: str) -> tuple[Any, Any]:
    import torch
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_dcp_size=1):
        dsa = DSATokenToKVPool(2 * TOKENS, TOKENS, kv_lora_rank=512, dtype=torch.bfloat16,
                               qk_rope_head_dim=64, layer_num=LAYERS, device="cpu",
                               index_head_dim=128, enable_memory_saver=False, kv_cache_dim=576,
                               start_layer=0, end_layer=LAYERS - 1)
    kv = MLATokenToKVPoolHost(dsa.get_device_pool_infos()[0].buffer_info, 1.0, 0, TOKENS, layout,
                              pin_memory=False, device="cpu", device_capacity_tokens=dsa.size,
                              start_layer=0, end_layer=LAYERS - 1,
                              host_token_capacity=pages * TOKENS, target_layer_num=LAYERS,
                              override_kv_cache_dim=576)
    return kv, DSAIndexerPoolHost(make_dsa_indexer_pool_decl(dsa), kv, pin_memory=False,
                                  device="cpu")


def _mamba(slots: int) -> Any:
    import torch
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(temporal=torch.zeros(8, slots, 8, 64, 64, dtype=torch.float32),
                                conv=(torch.zeros(8, slots, 3, 2048, dtype=torch.bfloat16),))
    return MambaPoolHost(info, 1.0, 0, device_capacity=slots, pin_memory=False, device="cpu",
                         layout="page_first")


def build_family(family: str, pages: int, layout: str) -> tuple[Any, str, Any, str, int]:
    """(KV host pool, sidecar pool name, sidecar host pool or None, hit policy, trailing)."""
    if family == "indexer":
        kv, idx = _dsa(pages, layout)
        return kv, "indexer", idx, "all_pages", 0
    kv = _mha(pages, layout, LAYERS)
    if family == "draft":
        return kv, "draft", _mha(pages, layout, 1), "all_pages", 0
    if family == "mamba":
        return kv, "mamba", _mamba(pages), "trailing_pages", 1
    if family == "swa":
        return kv, "swa", _mha(pages, layout, 8), "trailing_pages", 2
    return kv, "", None, "all_pages", 0


def _fill(pool: Any) -> None:
    import torch

    for p in range(int(pool.size) // int(pool.page_size)):
        page = pool.get_dummy_flat_data_page()
        raw = page.view(torch.uint8)
        raw.copy_(torch.frombuffer(bytearray(os.urandom(raw.numel())), dtype=torch.uint8))
        pool.set_from_flat_data_page(p * pool.page_size, page)


def _digests(pool: Any, starts: list[int]) -> list[int]:
    import torch
    import xxhash

    return [xxhash.xxh3_64_intdigest(pool.get_data_page(s, flat=True).contiguous()
                                     .view(torch.uint8).numpy()) for s in starts]


def _plan(n: int, trailing: int, batch: int) -> list[tuple[int, int, list[int]]]:
    """(first page, end page, sidecar page numbers) per batch."""
    out = []
    for a in range(0, n, batch):
        b = min(n, a + batch)
        side = list(range(a, b)) if trailing == 0 else list(range(max(a, b - trailing), b))
        out.append((a, b, side))
    return out


def bench_family(root: str, family: str, pages: int, layout: str, threads: int
                 ) -> dict[str, Any]:
    """Ours and the stock file backend doing the same calls; GB/s of KV + sidecar bytes."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import (
        STORAGE_BATCH_SIZE,
        HiCacheFile,
        HiCacheStorageConfig,
        PoolHitPolicy,
        PoolTransfer,
    )
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    kv, name, side, policy, trailing = build_family(family, pages, layout)
    _fill(kv)
    if side is not None:
        _fill(side)
    keys = [f"{os.urandom(8).hex()}{i:048x}" for i in range(pages)]
    plan = _plan(pages, trailing, STORAGE_BATCH_SIZE)
    kv_bytes = kv.get_size_per_token() * TOKENS
    side_bytes = 0 if side is None else side.get_size_per_token() * side.page_size
    total = pages * kv_bytes + sum(len(s) for *_, s in plan) * side_bytes
    mla = family == "indexer"

    def sc(extra: dict) -> Any:
        return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                    attn_cp_size=1, is_mla_model=mla,
                                    enable_storage_metrics=False, is_page_first_layout=False,
                                    model_name=f"bench/{family}", extra_config=extra)

    def tr(a: int, b: int, s: list[int]) -> list[Any]:
        if side is None:
            return []
        ps = side.page_size
        idx = torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in s])
        return [PoolTransfer(name=name, host_indices=idx, keys=[keys[p] for p in s],
                             hit_policy=PoolHitPolicy(policy))]

    def kv_idx(a: int, b: int) -> Any:
        return torch.arange(a * TOKENS, b * TOKENS)

    side_starts = [p * (side.page_size if side is not None else 1) for *_, s in plan for p in s]
    want = (_digests(kv, [p * TOKENS for p in range(pages)]),
            _digests(side, side_starts) if side is not None else [])

    def check(who: str) -> None:
        got = (_digests(kv, [p * TOKENS for p in range(pages)]),
               _digests(side, side_starts) if side is not None else [])
        if got != want:
            raise RuntimeError(f"{who}: pages read back differ from those written")

    def zero() -> None:
        for pool in (kv, side):
            if pool is not None:
                blank = pool.get_dummy_flat_data_page()
                for p in range(int(pool.size) // int(pool.page_size)):
                    pool.set_from_flat_data_page(p * pool.page_size, blank)

    out: dict[str, Any] = {"family": family, "pool": name or "kv only", "pages": pages,
                           "kv_page_bytes": kv_bytes, "sidecar_page_bytes": side_bytes,
                           "total_bytes": total}
    # --- stock: HiCacheFile, everything through its v2 calls
    d = os.path.join(root, "stock")
    stock = HiCacheFile(sc({"file_storage_path": d}), file_path=d)
    stock.register_mem_pool_host(kv)
    stock.register_mem_host_pool_v2(kv, "kv")
    if side is not None:
        stock.register_mem_host_pool_v2(side, name)

    def stock_io(write: bool) -> None:
        fn = stock.batch_set_v2 if write else stock.batch_get_v2
        for a, b, s in plan:
            kvt = PoolTransfer(name="kv", host_indices=kv_idx(a, b), keys=keys[a:b])
            res = fn([kvt] + tr(a, b, s))
            if not all(all(v) for v in res.values()):
                raise RuntimeError(f"stock: {'set' if write else 'get'} failed")
        if write:
            fsync_files(d, ".bin")

    w = timed(lambda: stock_io(True))
    drop_cache(d, ".bin")
    zero()
    r = timed(lambda: stock_io(False))
    check("stock")
    out["stock_file"] = {"write_gbps": total / w / 1e9, "read_gbps": total / r / 1e9}
    # --- ours
    extra = ours_extra(root, total, threads)
    ours = StorageBackendFactory.create_backend("dynamic", sc(extra), kv)
    try:
        ours.register_mem_pool_host(kv)
        if side is not None:
            ours.register_mem_host_pool_v2(side, name)
        ours.on_host_pools_registered()

        def ours_io(write: bool) -> None:
            for a, b, s in plan:
                kv_ok = (ours.batch_set_v1 if write else ours.batch_get_v1)(keys[a:b],
                                                                          kv_idx(a, b))
                res = (ours.batch_set_v2 if write else ours.batch_get_v2)(tr(a, b, s))
                if not all(kv_ok) or not all(all(v) for v in res.values()):
                    raise RuntimeError(f"offload: {'set' if write else 'get'} failed")

        w = timed(lambda: ours_io(True))
        if not ours.store.stats().extra.get("o_direct"):
            drop_cache(os.path.join(root, "offload"), ".slab")
        zero()
        r = timed(lambda: ours_io(False))
        check("offload")
    finally:
        ours.close()
    out["offload"] = {"write_gbps": total / w / 1e9, "read_gbps": total / r / 1e9}
    out["ratios"] = {"write_vs_stock": out["offload"]["write_gbps"] / out["stock_file"]["write_gbps"],
                     "read_vs_stock": out["offload"]["read_gbps"] / out["stock_file"]["read_gbps"]}
    return out
