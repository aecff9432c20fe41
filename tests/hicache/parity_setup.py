"""Builders for the parity tests (issue 20): storage configs with every field SGLang sets, MHA
`page_head` pools of any head count, MLA pools with decode context parallel."""

from __future__ import annotations

from typing import Any

import torch

from tests.hicache import hicache_pools as hp

HEADS = 4            # KV heads of the whole model: TP2 ranks hold 2, TP4 ranks 1
LAYERS, HEAD_DIM, PAGE = 2, 16, hp.PAGE


def storage_config(extra: dict, *, mla: bool = False, tp_rank: int = 0, tp_size: int = 1,
                   layout: str = "page_first", tp_lcm_size: int | None = None,
                   cp: tuple[int, int] = (0, 1), dcp: tuple[int, int] = (0, 1),
                   dp_rank: int = 0, metrics: bool = False) -> Any:
    """A HiCacheStorageConfig as HiCacheController._generate_storage_config builds it
    (should_split_heads by its rule, cache_controller.py: not MLA, page_head, lcm > TP)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    split = bool(tp_lcm_size) and not mla and layout == "page_head" and tp_lcm_size > tp_size
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=cp[0],
        attn_cp_size=cp[1], is_mla_model=mla, enable_storage_metrics=metrics,
        is_page_first_layout=layout == "page_first", model_name="test/model",
        tp_lcm_size=tp_lcm_size, should_split_heads=split, dp_rank=dp_rank, extra_config=extra,
        dcp_size=dcp[1], dcp_rank=dcp[0], logical_page_size=PAGE * dcp[1] if dcp[1] > 1 else None)


def mha_device_pool(heads: int) -> Any:
    """A device pool of `heads` KV heads per rank (SGLang's MHATokenToKVPool, on CPU)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(256, PAGE, torch.bfloat16, head_num=heads, head_dim=HEAD_DIM,
                            layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                            start_layer=0, end_layer=LAYERS - 1)


def mha_head_pool(heads: int, layout: str = "page_head", pages: int = 16) -> Any:
    """A host pool of `heads` KV heads per rank (SGLang's MHATokenToKVPoolHost)."""
    return hp.host_pool(mha_device_pool(heads), layout, pages)


def head_bytes(pool: Any, page: int, head: int) -> bytes:
    """K and V of one head of one page of a page_head pool (its kv_buffer is
    [2, page, head, token, layer, dim])."""
    return pool.kv_buffer[:, page, head].contiguous().view(torch.uint8).numpy().tobytes()


def mla_dcp_pool(dcp_rank: int, dcp_size: int = 2, layout: str = "page_first") -> Any:
    """An MLA host pool of one decode-context-parallel rank (page widened x dcp_size)."""
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    kv = hp.device_pool(mla=True)
    info = kv.get_device_pool_infos()[0].buffer_info
    return MLATokenToKVPoolHost(info, 2.0, 0, PAGE * dcp_size, layout, pin_memory=False,
                                device="cpu", device_capacity_tokens=kv.size, start_layer=0,
                                end_layer=hp.LAYERS - 1, host_token_capacity=16 * PAGE,
                                target_layer_num=kv.layer_num,
                                override_kv_cache_dim=kv.kv_cache_dim, dcp_size=dcp_size,
                                dcp_rank=dcp_rank)


def mla_allocator_only_pool(like: Any) -> Any:
    """An allocator-only MLA host pool (SGLang's `MLAHostAllocation`: no buffer), the geometry of
    `like`: what MLA host dedup gives the non-source ranks."""
    from sglang.srt.mem_cache.pool_host.mla import MLAHostAllocation, MLATokenToKVPoolHost

    geometry = MLAHostAllocation(dtype=like.dtype, kv_lora_rank=like.kv_lora_rank,
                                 qk_rope_head_dim=like.qk_rope_head_dim,
                                 kv_cache_dim=like.kv_cache_dim,
                                 size_per_token=like.get_size_per_token())
    return MLATokenToKVPoolHost(geometry, 2.0, 0, like.page_size, like.layout, pin_memory=False,
                                device="cpu", device_capacity_tokens=like.device_capacity_tokens,
                                start_layer=like.start_layer, end_layer=like.end_layer,
                                host_token_capacity=like.size, target_layer_num=like.layer_num)


def attach(sc: Any, anchor: Any, sidecars: dict | None = None) -> Any:
    """Through SGLang's factory, as its controller attaches: KV pool, sidecars, then done."""
    backend = hp.make_backend(sc, anchor)
    for name, pool in (sidecars or {}).items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


def idx(first_page: int, n: int, step: int = PAGE) -> torch.Tensor:
    return torch.arange(first_page * step, (first_page + n) * step)


def keys(n: int, tag: str = "") -> list[str]:
    return [f"{tag}{i:060x}".rjust(64, "0") for i in range(1, n + 1)]


def replica(extra: dict, tp_size: int, seed: int | None, lcm: int | None) -> list:
    """One replica of `tp_size` ranks on page_head pools: [(backend, pool)] by rank."""
    out = []
    for r in range(tp_size):
        pool = mha_head_pool(HEADS // tp_size)
        if seed is not None:
            hp.fill(pool, seed + r)
        sc = storage_config(extra, tp_rank=r, tp_size=tp_size, layout="page_head",
                            tp_lcm_size=lcm)
        out.append((attach(sc, pool), pool))
    return out


def head_of(backends: list, tp_size: int, head: int, page: int) -> bytes:
    """Global KV head `head` of `page`, wherever this replica holds it."""
    per = HEADS // tp_size
    return head_bytes(backends[head // per][1], page, head % per)
