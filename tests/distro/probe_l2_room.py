"""Probe: a storage (L3) hit under host-memory (L2) pressure (patch 0018), from whichever SGLang is
first on sys.path. Run with SGLANG_USE_CPU_ENGINE=1 (SGLang reads it at import):

    SGLANG_USE_CPU_ENGINE=1 python tests/distro/probe_l2_room.py   # prints PROBE {...}

Each cell builds SGLang's own stack, as the scheduler does: a device KV pool and its paged
allocator, `UnifiedRadixCache` (the Rust tree core where it loads) and `init_hicache` (host pool of
twice the device, write_through, `HybridCacheController`, SGLang's `file` L3 on a temporary
directory, or no L3), then drives it as the scheduler would, by hand:

1. request S finishes: inserted, written through to host and on to the L3, acked; then evicted
   from device and host, so only the L3 holds it;
2. the host pool comes under pressure, two ways (`<pressure>`):
   - `acks` (host twice the device, S 16 pages): requests T1, T2 (12 pages each) finish and are
     evicted from the device: host-only, their L3 write-backs done by the backend but not yet acked
     to the tree (an ack is drained only at the scheduler's next drain), so their host pages are
     locked: 9 of 33 host pages free;
   - `device` (host as large as the device, S 12 pages): request T (12 pages) finishes and stays on
     the device, its host copy written to the L3 and acked: 5 of 17 host pages free, the rest a
     copy of device pages that upstream's write_through eviction never takes;
3. S comes back: its prefetch finds it all in the L3; drains run until the load is inserted.

`probe()` returns, per cell `<l3>/<pressure>/<prefetch policy>/<wait ticks>` (ticks `default`, `0`;
one cell `skip-reclaim` sets SGLANG_HICACHE_SKIP_HOST_DUPLICATE_RECLAIM=1): the tokens of S loaded
from the L3 (`loaded`), and the host pool's free tokens and the tree's host hit for S at the end
(`host`). Without an L3 the cell stops after step 2 (`loaded` is None).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from array import array

import torch

PAGE = 16
DEVICE_PAGES = 16
POLICIES = ("wait_complete", "timeout", "best_effort")
TICKS = ("default", "0")   # SGLANG_HICACHE_STORAGE_HIT_HOST_ROOM_WAIT_TICKS unset, or 0
ENV_TICKS = "SGLANG_HICACHE_STORAGE_HIT_HOST_ROOM_WAIT_TICKS"
ENV_SKIP_RECLAIM = "SGLANG_HICACHE_SKIP_HOST_DUPLICATE_RECLAIM"   # "skip-reclaim" sets it
_group_ready = False


def _wait_for(cond, what: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"gave up waiting for {what}")
        time.sleep(0.01)


def _build(l3: str, policy: str, ratio: str):
    """SGLang's cache stack for one cell: (cache, allocator)."""
    global _group_ready
    import torch.distributed as dist
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", "dummy", "--device", "cpu", "--page-size", str(PAGE),
            "--enable-hierarchical-cache", "--hicache-ratio", ratio,
            "--hicache-write-policy", "write_through",
            "--hicache-storage-prefetch-policy", policy]
    if l3 == "file":
        os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = tempfile.mkdtemp(prefix="l2room-")
        argv += ["--hicache-storage-backend", "file",
                 "--hicache-storage-backend-extra-config", json.dumps({"prefetch_threshold": PAGE})]
    args = prepare_server_args(argv)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    if not _group_ready:
        fd, path = tempfile.mkstemp(prefix="l2room-gloo-")
        os.close(fd)
        os.unlink(path)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
        _group_ready = True

    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    tokens = DEVICE_PAGES * PAGE
    kv = MHATokenToKVPool(tokens, PAGE, torch.bfloat16, head_num=2, head_dim=64, layer_num=2,
                          device="cpu", enable_memory_saver=False, start_layer=0, end_layer=1)
    alloc = PagedTokenToKVPoolAllocator(tokens, PAGE, torch.bfloat16, "cpu", kv, False)
    params = CacheInitParams(
        disable=False, page_size=PAGE, token_to_kv_pool_allocator=alloc,
        req_to_token_pool=ReqToTokenPool(size=8, max_context_len=1024, device="cpu",
                                         enable_memory_saver=False),
        tree_components=(ComponentType.FULL,), enable_metrics=False,
        tp_cache_group=dist.group.WORLD)
    cache = UnifiedRadixCache(params)
    cache.init_hicache(args, params)
    return cache, alloc


def _cell(l3: str, pressure: str, policy: str, ticks: str) -> dict:
    from sglang.srt.mem_cache.base_prefix_cache import (
        CacheRequestHandle,
        EvictParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.radix_cache import RadixKey

    os.environ.pop(ENV_TICKS, None)
    os.environ.pop(ENV_SKIP_RECLAIM, None)
    if ticks == "skip-reclaim":
        os.environ[ENV_SKIP_RECLAIM] = "1"
    elif ticks != "default":
        os.environ[ENV_TICKS] = ticks
    cache, alloc = _build(l3, policy, "2" if pressure == "acks" else "1")
    cc = cache.cache_controller
    host = cc.mem_pool_host

    def finish(tokens: list[int]) -> None:
        """A finished request: its KV inserted, written through to host (and the L3 write issued)."""
        cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=alloc.alloc(len(tokens))))
        cache.writing_check(write_back=True)

    def acks_queued() -> bool:
        return cc.ack_backup_queue is None or cc.ack_backup_queue.qsize() >= len(cache.ongoing_backup)

    def settle() -> None:
        if l3 == "file":
            _wait_for(acks_queued, "the L3 write-backs")
            cache.drain_storage_control_queues()

    def host_hit(tokens: list[int]) -> int:
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
        return match.device_prefix_len + match.host_hit_length

    s = list(range(1000, 1000 + (16 if pressure == "acks" else 12) * PAGE))
    finish(s)
    settle()
    cache.evict(EvictParams(num_tokens=len(s)))
    cache.evict_host(len(s))
    if pressure == "acks":      # two host-only requests, their L3 acks not drained yet
        for first in (5000, 9000):
            t = list(range(first, first + 12 * PAGE))
            finish(t)
            cache.evict(EvictParams(num_tokens=len(t)))
    else:                       # one request still on the device, its host copy backed up
        finish(list(range(5000, 5000 + 12 * PAGE)))
        settle()
    if l3 != "file":
        return {"loaded": None, "host": [host.available_size(), host_hit(s)]}

    _wait_for(acks_queued, "the L3 write-backs")
    handle = CacheRequestHandle(rid="s", attempt_id=0)
    cache.prefetch_from_storage(handle, cache.tree_core.root_node_handle(), array("q", s), None,
                                None, matched_prefix_tokens=[])
    _wait_for(lambda: cc.prefetch_hit_queue.qsize() == 1, "S's L3 hit query")
    end = time.monotonic() + 120
    while cache.has_ongoing_prefetch(handle):   # the scheduler's drain, once per iteration
        cache.drain_storage_control_queues()
        if time.monotonic() > end:
            raise TimeoutError("S's prefetch never finished")
        time.sleep(0.005)
    loaded = cache.pop_prefetch_loaded_tokens(handle)
    return {"loaded": loaded, "host": [host.available_size(), host_hit(s)]}


def probe() -> dict:
    cells = {}
    for l3, pressure in (("file", "acks"), ("file", "device"), ("none", "acks")):
        for policy in POLICIES:
            for ticks in TICKS:
                name = f"{l3}/{pressure}/{policy}/{ticks}"
                try:
                    cells[name] = _cell(l3, pressure, policy, ticks)
                except Exception:  # reported to the test, which shows it
                    cells[name] = {"error": traceback.format_exc(limit=8)}
    name = "file/device/best_effort/skip-reclaim"
    try:
        cells[name] = _cell("file", "device", "best_effort", "skip-reclaim")
    except Exception:  # reported to the test, which shows it
        cells[name] = {"error": traceback.format_exc(limit=8)}
    return {"cells": cells}


if __name__ == "__main__":
    print("PROBE " + json.dumps(probe()))
