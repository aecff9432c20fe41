"""Probe: SGLang's CPU engine without sgl_kernel (patches 0002-0005), from whichever SGLang is first
on sys.path. Run with SGLANG_USE_CPU_ENGINE=1 (SGLang reads it at import):

    SGLANG_USE_CPU_ENGINE=1 python tests/distro/probe_cpu_engine.py   # prints PROBE {...}

`probe()` returns, each as "ok" or the error:
- `fallbacks`: the torch `copy_all_layer_kv_cache` and `assign_req_to_token_pool` against the
  reference semantics written out here (small tensors, overlapping moves, padded index tensors),
  and that the speculative kernel modules import;
- `host_pool`: an MHA host pool built with SGLang's default `pin_memory=True` allocates without
  CUDA host registration and hands out a flat data page;
- `roundtrip`: for each pool kind (MHA in float32 and in float8_e4m3fn, an FP8 KV cache; MLA;
  Mamba: SGLang's own host pool classes on CPU tensors) x layout x io backend, a backup of
  scattered device rows to the host pool, the bytes where SGLang's own `get_data_page` says they
  are, then a load back into cleared device rows.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable

import torch

PAGE = 4
LAYERS = 3
TOKENS = 64          # device slots
HOST_BUDGET = 1 << 30
KINDS_LAYOUTS = {
    "mha": ("layer_first", "page_first", "page_first_direct", "page_head"),
    "mha_fp8": ("layer_first", "page_first", "page_first_direct", "page_head"),  # float8 KV
    "mla": ("layer_first", "page_first", "page_first_direct"),
    "mamba": ("page_first", "page_first_direct"),
}
IO_BACKENDS = ("kernel", "direct")
# How the device indices of a transfer are ordered: whole pages in order (HiCache's page-aligned
# transfers: patch 0005's page-granular copy) or the same pages' tokens reversed (its row copy).
ORDERS = ("pages", "rows")


def _run(check: Callable[[], None]) -> str:
    try:
        check()
    except Exception:  # reported to the test, which shows it
        return "error: " + traceback.format_exc(limit=6)
    return "ok"


def _eq(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.dtype == b.dtype == torch.float8_e4m3fn:   # torch.equal has no float8 kernel: the bytes
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    if not torch.equal(a, b):
        raise AssertionError(f"{what}: differs")


def check_copy_all_layer() -> None:
    from sglang.kernels.ops.kvcache import cache_move

    assert cache_move.copy_all_layer_kv_cache_cpu is cache_move._copy_all_layer_kv_cache_torch
    gen = torch.Generator().manual_seed(1)
    buffers = [torch.randint(0, 255, (16, 12), dtype=torch.uint8, generator=gen),
               torch.randn(16, 2, 5, generator=gen).to(torch.bfloat16)]
    before = [b.clone() for b in buffers]
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b[0].nbytes for b in buffers], dtype=torch.int64)
    src = torch.tensor([0, 1, 2, 9, 7, 7], dtype=torch.int64)   # overlapping move 0..2 -> 1..3
    tgt = torch.tensor([1, 2, 3, 15, 5, 0], dtype=torch.int64)
    num = 5                                                      # the 6th pair is padding
    cache_move.copy_all_layer_kv_cache_func(ptrs, strides, tgt, src, num, 8, {})
    for b, old in zip(buffers, before):
        want = old.clone()
        for s, t in zip(src[:num].tolist(), tgt[:num].tolist()):
            want[t] = old[s]                                     # every read before any write
        _eq(b, want, f"copy_all_layer_kv_cache {b.dtype}")


def check_assign_req_to_token_pool() -> None:
    from sglang.srt.mem_cache import allocation

    assert allocation.assign_req_to_token_pool_cpu is allocation._assign_req_to_token_pool_torch
    req_to_token = torch.full((4, 32), -1, dtype=torch.int32)
    reqs = torch.tensor([2, 0, 3], dtype=torch.int64)
    start = torch.tensor([5, 0, 30], dtype=torch.int64)
    end = torch.tensor([9, 3, 32], dtype=torch.int64)
    out_cache_loc = torch.arange(100, 109, dtype=torch.int64)
    allocation.assign_req_to_token_pool_func(reqs, req_to_token, start, end, out_cache_loc, 3)
    want = torch.full((4, 32), -1, dtype=torch.int32)
    offset = 0
    for r, s, e in zip(reqs.tolist(), start.tolist(), end.tolist()):
        for col in range(s, e):
            want[r, col] = int(out_cache_loc[offset])
            offset += 1
    _eq(req_to_token, want, "assign_req_to_token_pool")


def check_speculative_imports() -> None:
    import importlib

    for name in ("eagle", "multi_layer_eagle", "cache_locs", "spec_tree"):
        importlib.import_module(f"sglang.kernels.ops.speculative.{name}")


def _mha_pool(layout: str, pin_memory: bool = True, dtype: torch.dtype = torch.float32):
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    heads, dim = 2, 8
    gen = torch.Generator().manual_seed(2)
    k = tuple(torch.randn(TOKENS, heads, dim, generator=gen).to(dtype) for _ in range(LAYERS))
    v = tuple(torch.randn(TOKENS, heads, dim, generator=gen).to(dtype) for _ in range(LAYERS))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
                          v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
                          layout=KVBufferLayout.NHD),
        page_size=PAGE, head_num=heads, head_dim=dim, v_head_dim=dim, dtype=dtype,
        device=torch.device("cpu"))
    with host_memory_budget_scope(HOST_BUDGET):
        pool = MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=pin_memory,
                                    device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS)
    device = [(k[i], v[i]) for i in range(LAYERS)]

    def page_rows(page: torch.Tensor, layer: int, offset: int) -> list[torch.Tensor]:
        # get_data_page(flat=False) of each layout (mha.py), K and V rows of one token
        if layout == "layer_first":      # [2, layer, page_size, head, dim]
            return [page[c, layer, offset] for c in (0, 1)]
        if layout == "page_first":       # [2, page_size, layer, head, dim]
            return [page[c, offset, layer] for c in (0, 1)]
        if layout == "page_first_direct":  # [2, 1, layer, page_size, head, dim]
            return [page[c, 0, layer, offset] for c in (0, 1)]
        return [page[c, 0, :, offset, layer] for c in (0, 1)]  # page_head: [2,1,head,ps,layer,dim]

    return pool, device, page_rows


def _mla_pool(layout: str):
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    lora, rope = 8, 4
    gen = torch.Generator().manual_seed(3)
    kv = tuple(torch.randn(TOKENS, 1, lora + rope, generator=gen) for _ in range(LAYERS))
    info = MLABufferInfo(
        buffers=kv, data_ptrs=torch.tensor([t.data_ptr() for t in kv], dtype=torch.uint64),
        layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS, page_size=PAGE,
        kv_lora_rank=lora, qk_rope_head_dim=rope, kv_cache_dim=lora + rope, dtype=torch.float32,
        device=torch.device("cpu"))
    with host_memory_budget_scope(HOST_BUDGET):
        pool = MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, device_capacity_tokens=TOKENS,
                                    start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS)
    device = [(kv[i],) for i in range(LAYERS)]

    def page_rows(page: torch.Tensor, layer: int, offset: int) -> list[torch.Tensor]:
        if layout == "layer_first":      # [layer, page_size, 1, dim]
            return [page[layer, offset]]
        if layout == "page_first":       # [page_size, layer, 1, dim]
            return [page[offset, layer]]
        return [page[0, layer, offset]]  # page_first_direct: [1, layer, page_size, 1, dim]

    return pool, device, page_rows


def _mamba_pool(layout: str):
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    gen = torch.Generator().manual_seed(4)
    temporal = torch.randn(LAYERS, TOKENS, 2, 3, generator=gen)
    conv = (torch.randn(LAYERS, TOKENS, 5, generator=gen), torch.randn(LAYERS, TOKENS, 4, generator=gen))
    info = MambaStateBufferInfo(temporal=temporal, conv=conv)
    with host_memory_budget_scope(HOST_BUDGET):
        pool = MambaPoolHost(info, 2.0, 0, device_capacity=TOKENS, layout=layout)
    device = [(temporal[i], *(c[i] for c in conv)) for i in range(LAYERS)]
    return pool, device, None


def check_roundtrip(kind: str, layout: str, io_backend: str, order: str = "pages") -> None:
    pool, device, page_rows = {
        "mha": _mha_pool, "mla": _mla_pool, "mamba": _mamba_pool,
        "mha_fp8": lambda la: _mha_pool(la, dtype=torch.float8_e4m3fn)}[kind](layout)
    page = pool.page_size
    originals = [tuple(t.clone() for t in layer) for layer in device]
    # Two scattered device pages, into two host pages the pool hands out.
    device_indices = torch.cat([torch.arange(12, 12 + page), torch.arange(4, 4 + page)])
    if order == "rows":
        device_indices = device_indices.flip(0)
    host_indices = pool.alloc(2 * page)
    assert host_indices is not None
    pool.backup_from_device_all_layer(None, host_indices, device_indices, io_backend)
    if page_rows is not None:  # the bytes are where SGLang's own page accessor reads them
        for first in (0, page):
            data = pool.get_data_page(int(host_indices[first]), flat=False)
            for layer in range(LAYERS):
                for offset in range(page):
                    row = int(device_indices[first + offset])
                    for got, want in zip(page_rows(data, layer, offset), originals[layer]):
                        _eq(got, want[row], f"host page row layer {layer} offset {offset}")
    for layer in device:
        for t in layer:
            t[device_indices] = 0
    for layer_id in range(LAYERS):
        pool.load_to_device_per_layer(None, host_indices, device_indices, layer_id, io_backend)
    for layer_id, (now, before) in enumerate(zip(device, originals)):
        for got, want in zip(now, before):
            _eq(got, want, f"device layer {layer_id} after the load")


def check_whole_pages() -> None:
    from sglang.srt.mem_cache.pool_host.torch_transfer import whole_pages

    assert whole_pages(torch.tensor([8, 9, 10, 11, 0, 1, 2, 3]), 4).tolist() == [2, 0]
    for indices in ([8, 9, 10, 11, 0, 1, 2], [9, 10, 11, 12], [8, 10, 9, 11], []):
        assert whole_pages(torch.tensor(indices, dtype=torch.int64), 4) is None, indices
    assert whole_pages(torch.arange(4), 1) is None


def check_host_pool_without_registration() -> None:
    pool, _, _ = _mha_pool("page_first", pin_memory=True)
    assert pool.pin_memory is False, "the CPU engine must not pin host pools"
    assert pool.get_dummy_flat_data_page().numel() > 0


def probe() -> dict:
    return {
        "fallbacks": {
            "copy_all_layer_kv_cache": _run(check_copy_all_layer),
            "assign_req_to_token_pool": _run(check_assign_req_to_token_pool),
            "speculative_imports": _run(check_speculative_imports),
        },
        "host_pool": _run(check_host_pool_without_registration),
        "whole_pages": _run(check_whole_pages),
        "roundtrip": {
            f"{kind}/{layout}/{io}" + ("" if order == "pages" else f"/{order}"):
                _run(lambda k=kind, la=layout, i=io, o=order: check_roundtrip(k, la, i, o))
            for kind, layouts in KINDS_LAYOUTS.items() for layout in layouts for io in IO_BACKENDS
            for order in (ORDERS if kind != "mamba" else ORDERS[:1])
        },
    }


if __name__ == "__main__":
    print("PROBE " + json.dumps(probe()))
