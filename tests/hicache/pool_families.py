"""Real SGLang hybrid host pools on CPU, one builder per model family (the v2 pool tests).

Each builder returns (anchor KV host pool, {PoolName: (host pool, hit policy, indices_from_pool,
trailing pages)}), built with SGLang 0.5.23's own classes the way `hybrid_pool_assembler` does.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.hicache.hicache_pools import LAYERS, PAGE, device_pool, host_pool

PAGES = 32
FAMILIES = ("draft", "indexer", "mamba", "swa", "dsv4")


def _mha(layers: int, layout: str, pages: int = PAGES) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    kv = MHATokenToKVPool(256, PAGE, torch.bfloat16, head_num=1, head_dim=32, layer_num=layers,
                          device="cpu", enable_memory_saver=False, start_layer=0,
                          end_layer=layers - 1)
    return host_pool(kv, layout, pages)


def _dsa_anchor(layout: str) -> tuple[Any, Any]:
    """DeepSeek-V3.2's stack: a DSA device pool (64-token pages) and its MLA host pool."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_dcp_size=1):
        dsa = DSATokenToKVPool(512, 64, kv_lora_rank=64, dtype=torch.bfloat16,
                               qk_rope_head_dim=16, layer_num=LAYERS, device="cpu",
                               index_head_dim=128, enable_memory_saver=False, kv_cache_dim=80,
                               start_layer=0, end_layer=LAYERS - 1)
    info = dsa.get_device_pool_infos()[0].buffer_info
    anchor = MLATokenToKVPoolHost(info, 2.0, 0, 64, layout, pin_memory=False, device="cpu",
                                  device_capacity_tokens=dsa.size, start_layer=0,
                                  end_layer=LAYERS - 1, host_token_capacity=16 * 64,
                                  target_layer_num=LAYERS, override_kv_cache_dim=80)
    return dsa, anchor


def _indexer(dsa: Any, anchor: Any) -> Any:
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl

    return DSAIndexerPoolHost(make_dsa_indexer_pool_decl(dsa), anchor, pin_memory=False,
                              device="cpu")


def _mamba(slots: int = PAGES) -> Any:
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(temporal=torch.zeros(2, slots, 4, 8, dtype=torch.float32),
                                conv=(torch.zeros(2, slots, 3, 16, dtype=torch.bfloat16),))
    return MambaPoolHost(info, 1.0, 0, device_capacity=slots, pin_memory=False, device="cpu",
                         layout="page_first")


def build(family: str, layout: str = "page_first") -> tuple[Any, dict[Any, tuple]]:
    """(anchor, {name: (pool, policy, indices_from_pool, trailing)}) for one family."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy as P
    from sglang.srt.mem_cache.hicache_storage import PoolName as N

    if family == "draft":
        anchor = host_pool(device_pool(), layout, PAGES)
        return anchor, {N.DRAFT: (_mha(1, layout), P.ALL_PAGES, N.KV, 0)}
    if family == "indexer":
        dsa, anchor = _dsa_anchor(layout)
        return anchor, {N.INDEXER: (_indexer(dsa, anchor), P.ALL_PAGES, N.KV, 0)}
    if family == "mamba":
        anchor = host_pool(device_pool(), layout, PAGES)
        return anchor, {N.MAMBA: (_mamba(), P.TRAILING_PAGES, None, 1)}
    if family == "swa":
        anchor = host_pool(device_pool(), layout, PAGES)
        return anchor, {N.SWA: (_mha(2, layout), P.TRAILING_PAGES, None, 2)}
    if family == "dsv4":
        from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool

        anchor = LogicalHostPool(PAGES * PAGE, PAGE, layout)
        return anchor, {N.DEEPSEEK_V4_C4: (_mha(2, layout), P.ALL_PAGES, N.KV, 0)}
    raise ValueError(family)


def fill_any(pool: Any, seed: int) -> None:
    """Seeded random bytes into every page of a host pool (through SGLang's own page setter)."""
    g = torch.Generator().manual_seed(seed)
    n = int(pool.size) // int(pool.page_size)
    for p in range(n):
        page = pool.get_dummy_flat_data_page()
        raw = page.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
        pool.set_from_flat_data_page(p * pool.page_size, page)


def page_of(pool: Any, token_index: int) -> bytes:
    return pool.get_data_page(token_index, flat=True).contiguous().view(torch.uint8).numpy().tobytes()
