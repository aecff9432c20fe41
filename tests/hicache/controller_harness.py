"""Drive SGLang's real `HiCacheController` on CPU: its storage threads, backup and prefetch.

What a scheduler does around the controller (the tree cache allocating host memory for a storage
hit, reading the acks) is done here by hand; the device<->host copy needs CUDA, so tests fill the
host pool directly. One process-wide gloo group of one rank is created on first use.
"""

from __future__ import annotations

import os
import tempfile
import threading
from queue import Empty
from typing import Any

import torch

from tests.hicache.hicache_pools import PAGE

_ready = False


def init_runtime() -> None:
    """Publish a CPU server config and a one-rank gloo group (once per process)."""
    global _ready
    if _ready:
        return
    import torch.distributed as dist
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    publish(prepare_server_args(["--model-path", "dummy", "--device", "cpu"]), role="scheduler",
            ranks=SpawnRanks(world_rank=0))
    if not dist.is_initialized():
        fd, path = tempfile.mkstemp(prefix="offload-gloo-")
        os.close(fd)
        os.unlink(path)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    _ready = True


def make_controller(kv: Any, host: Any, extra: dict, model: str = "test/model") -> Any:
    """A HiCacheController over device pool `kv` and host pool `host`, storage attached."""
    init_runtime()
    import torch.distributed as dist
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    alloc = PagedTokenToKVPoolAllocator(kv.size, PAGE, kv.dtype, "cpu", kv, False)
    return HiCacheController(alloc, host, PAGE, dist.group.WORLD, threading.Event(),
                             storage_backend="dynamic", model_name=model,
                             storage_backend_extra_config=dict(extra),
                             enable_storage_metrics=True)


def page_hashes(token_ids: list[int]) -> list[str]:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(token_ids, None, page_size=PAGE)


def backup(ctrl: Any, host_indices: torch.Tensor, token_ids: list[int]) -> int:
    """`write_storage` and wait for its ack; returns the tokens written."""
    ctrl.write_storage(host_indices, token_ids, hash_value=page_hashes(token_ids))
    op = ctrl.ack_backup_queue.get(timeout=60)
    return op.completed_tokens


def prefetch(ctrl: Any, host: Any, token_ids: list[int], rid: str = "r") -> tuple[int, int, Any]:
    """Hit query, then load the hit into fresh host pages, as the tree cache does.

    Returns (tokens the hit query found, tokens loaded, host indices of the load or None).
    """
    op = ctrl.prefetch(rid, token_ids)
    hit_op = ctrl.prefetch_hit_queue.get(timeout=60)
    assert hit_op is op
    hits = op.storage_hit_count
    if hits == 0:
        return 0, 0, None
    indices = host.alloc(hits)
    op.host_indices = indices
    ctrl.prefetch_buffer.put(op)
    loaded = 0
    while True:
        try:
            ack = ctrl.ack_prefetch_queue.get(timeout=60)
        except Empty:
            raise TimeoutError("no prefetch ack from the controller") from None
        if ack.completed_tokens is not None:
            loaded = max(loaded, ack.completed_tokens)
        if ack.completed_req:
            return hits, loaded, indices
