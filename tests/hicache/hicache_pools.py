"""Small real SGLang KV pools on CPU for the HiCache backend tests (and the test worker)."""

from __future__ import annotations

from typing import Any

import torch

LAYERS, HEADS, HEAD_DIM, PAGE = 4, 2, 64, 16
LAYOUTS = ("page_first", "page_first_direct", "layer_first")


def device_pool(mla: bool = False, tokens: int = 256) -> Any:
    if mla:
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

        return MLATokenToKVPool(tokens, PAGE, torch.bfloat16, kv_lora_rank=64,
                                qk_rope_head_dim=16, layer_num=LAYERS, device="cpu",
                                enable_memory_saver=False, start_layer=0, end_layer=LAYERS - 1)
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(tokens, PAGE, torch.bfloat16, head_num=HEADS, head_dim=HEAD_DIM,
                            layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                            start_layer=0, end_layer=LAYERS - 1)


def host_pool(kv: Any, layout: str, pages: int = 32) -> Any:
    """A host pool of `pages` pages (plus SGLang's padding page) mirroring device pool `kv`."""
    info = kv.get_device_pool_infos()[0].buffer_info
    common = dict(pin_memory=False, device="cpu", device_capacity_tokens=kv.size,
                  start_layer=kv.start_layer, end_layer=kv.end_layer,
                  host_token_capacity=pages * PAGE)
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    if isinstance(kv, MLATokenToKVPool):
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        return MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, target_layer_num=kv.layer_num,
                                    override_kv_cache_dim=kv.kv_cache_dim, **common)
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    return MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, **common)


def fill(pool: Any, seed: int) -> None:
    """Fill the whole host pool with seeded random bytes."""
    g = torch.Generator().manual_seed(seed)
    flat = pool.kv_buffer.view(-1).view(torch.int16)
    flat.copy_(torch.randint(-32768, 32767, flat.shape, generator=g, dtype=torch.int16))


def page_bytes(pool: Any, token_index: int) -> bytes:
    """SGLang's own flat view of one page, as bytes."""
    page = pool.get_data_page(token_index, flat=True).contiguous()
    return page.view(torch.uint8).numpy().tobytes()


def storage_config(extra: dict, *, mla: bool = False, tp_rank: int = 0, tp_size: int = 1,
                   model: str = "test/model", metrics: bool = False, layout: str = "page_first"):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=metrics,
        is_page_first_layout=layout == "page_first", model_name=model, extra_config=extra)


def extra(store_dir: str, **offload: Any) -> dict:
    tree = {"store": {"path": store_dir, "capacity": "256MiB", "min_free": 0}}
    for k, v in offload.items():
        tree.setdefault(k, {}).update(v)
    return {"backend_name": "offload", "module_path": "offload.hicache",
            "class_name": "OffloadStorage", "interface_v1": 1, "offload": tree}


def make_backend(sc: Any, pool: Any) -> Any:
    """Through SGLang's own factory, exactly as its controller does."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("dynamic", sc, pool)
    backend.register_mem_pool_host(pool)
    return backend


def durable(backend: Any) -> None:
    """Wait until what `backend` wrote is visible to other store instances (the disk store's
    group commit makes blocks visible to other processes once durable)."""
    store = backend.store
    while store is not None:
        flush = getattr(store, "flush", None)
        if callable(flush):
            flush()
            return
        store = getattr(store, "store", None)
