"""The SGLang HiCache L3 storage backend: `OffloadStorage`, a `HiCacheStorage` over a block store.

SGLang loads it through its `dynamic` storage backend:

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "offload", "module_path": "offload.hicache", "class_name": "OffloadStorage",
      "interface_v1": 1, "offload": {"store": {"path": "/nvme/kv", "capacity": "2TiB"}}}'

Lifecycle: SGLang constructs `OffloadStorage(storage_config, kwargs)` in each scheduler process
(settings are validated here; a bad one raises `ConfigError` naming it), then calls
`register_mem_pool_host(host_pool)`, which fixes the block namespace (model, ranks, MLA, dtype,
layout, page size, salt) and the page map (`offload.hicache.layout`); hybrid stacks then register
their sidecar pools (`register_mem_host_pool_v2`, the v2 interface in `offload.hicache.pools`;
DeepSeek-V4's anchor holds no bytes: a "logical anchor"). Then, from its storage
threads: `batch_exists` (leading hits), `batch_set_v1` / `batch_get_v1` (pages moved straight
between host-pool memory and the store, no copy), or the legacy `get/set/batch_get/batch_set`
(flat page tensors). `close` closes the store.

Data path: every call returns per-page success; nothing raises into SGLang. A failed or corrupt
read is a miss (the store verifies checksums). MLA: every TP rank reads one shared namespace and
only the storage writer (rank 0) writes. The store is opened by `_open_store(cfg)`, the one place
to swap in another tier (tests inject a `MemoryStore`).

Metrics (`offload.metrics`, unless `offload.metrics.enabled: false`): load/store latency, the
path, the worth-it decisions, and per-tier counters read from the store's stats by a watcher
thread; SGLang's own `StorageMetrics` come from `get_stats`. The worth-it rule
(`offload.hicache.worth_it`): `batch_exists` reports the leading hits only if loading them is faster than
recomputing them, at the read bandwidth measured on this backend's loads.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, List, Sequence

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from offload.config import OffloadConfig, load_file, load_offload, to_dict
from offload.errors import ConfigError
from offload.hicache.contract import EXTRA_KEYS, SGLANG_KEYS
from offload.hicache.layout import PageMap
from offload.hicache.page_io import page_starts, read_pages, write_pages
from offload.hicache.pools import KV, Pool, PoolsMixin
from offload.hicache.worth_it import WorthIt, cuda_gpu_name, from_config
from offload.keys import Namespace, key_maker
from offload.metrics import (
    StoreWatch,
    TierMetrics,
    count_agent,
    counted_by_backend,
    path_of,
    serve,
    tier_metrics,
)
from offload.store.base import BlockStore, Buffer, all_false, leading_hits, never_raises

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

def settings_from_extra(extra: dict | None) -> OffloadConfig:
    """The `offload:` settings from SGLang's extra config.

    `config_file` (a deployment YAML; its `offload:` section) is the base, and the inline
    `offload` tree overrides keys of it. Raises ConfigError naming every bad key.
    """
    extra = dict(extra or {})
    problems = []
    for key in extra:
        if key not in EXTRA_KEYS and key not in SGLANG_KEYS:
            problems.append(f"hicache-storage-backend-extra-config.{key}: unknown key; allowed: "
                            + ", ".join(EXTRA_KEYS))
    inline = extra.get("offload")
    if inline is not None and not isinstance(inline, dict):
        problems.append("hicache-storage-backend-extra-config.offload: expected a mapping (the "
                        f"YAML offload: section), got {type(inline).__name__}")
    path = extra.get("config_file")
    if path is not None and not isinstance(path, str):
        problems.append(f"hicache-storage-backend-extra-config.config_file: {path!r} is not a path")
    if problems:
        raise ConfigError(problems)
    tree: dict = to_dict(load_file(path).offload) if path else {}
    return load_offload(_merge(tree, inline or {}))


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _open_store(cfg: OffloadConfig) -> BlockStore:
    """Open the store the settings name (the one factory; tests replace it): the transfer path
    (`offload.transfer.path`, or detection's choice for `auto`: cpu staging into the local
    `DiskStore`, or the DPU agent), tiered over Redis when `offload.redis.url` is set. `launch`
    passes the decided path explicitly, so scheduler processes do not rerun detection."""
    from offload.store.tiered import make_tiered
    from offload.transfer.base import open_path

    return make_tiered(open_path(cfg), cfg.redis)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def namespace_for(storage_config: HiCacheStorageConfig, host_pool: Any, page_bytes: int,
                  salt: str) -> Namespace:
    """The block namespace of one rank's host pool.

    MLA KV is the same on every TP rank: all ranks share the namespace of rank 0 of a 1-rank
    group. Everything else that changes a page's bytes goes into `extra`.
    """
    sc = storage_config
    mla = bool(sc.is_mla_model)
    extra = (f"pool={type(host_pool).__name__};layers={getattr(host_pool, 'layer_num', '')};"
             f"page_bytes={page_bytes};cp={sc.attn_cp_rank}/{sc.attn_cp_size}")
    if sc.dcp_size > 1:
        extra += f";dcp={sc.dcp_rank}/{sc.dcp_size}"
    return Namespace(
        model=sc.model_name or "", dtype=_dtype_name(host_pool.dtype),
        layout=str(host_pool.layout), page_size=int(host_pool.page_size),
        tp_rank=0 if mla else sc.tp_rank, tp_size=1 if mla else sc.tp_size,
        pp_rank=sc.pp_rank, pp_size=sc.pp_size, mla=mla, salt=salt, extra=extra)


class OffloadStorage(PoolsMixin, HiCacheStorage):
    """SGLang HiCache storage backend over an `offload` block store (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        extra = dict(storage_config.extra_config or {})
        extra.update(kwargs or {})
        self.cfg = settings_from_extra(extra)
        self.storage_config = storage_config
        self.zero_copy_interface = bool(extra.get("interface_v1", 0))
        if not self.zero_copy_interface:
            logger.warning("offload: interface_v1 is not set in the extra config; SGLang will use "
                           "the legacy copying interface")
        self.is_writer = storage_config.is_storage_writer
        self.store: BlockStore = _open_store(self.cfg)
        self.mem_pool_host: Any = None
        self.pages: PageMap | None = None
        self.namespace: Namespace | None = None
        self._ns_digest = b""
        self._make_keys: Callable[[Sequence[str]], list[bytes]] = key_maker(b"")
        self.pools: dict[str, Pool] = {}
        self.logical_anchor = False
        self._lock = threading.Lock()
        self._metrics = storage_config.enable_storage_metrics
        # Since the last get_stats(): pages and GiB/s of each prefetch / backup call.
        self._pgs: dict[str, list[int]] = {"prefetch": [], "backup": []}
        self._bw: dict[str, list[float]] = {"prefetch": [], "backup": []}
        self.transfer_path = path_of(self.store)
        self._count_agent = counted_by_backend(self.store)
        self.worth: WorthIt = from_config(self.cfg.worth_it, storage_config.model_name or "",
                                          storage_config.tp_size, cuda_gpu_name)
        self.tm: TierMetrics | None = None
        self._watch: StoreWatch | None = None
        if self.cfg.metrics.enabled:
            self.tm = tier_metrics()
            self.tm.set_path(self.transfer_path)
            self._watch = StoreWatch(self.store, self.tm).start()
            serve(self.cfg.metrics, storage_config.pp_rank * storage_config.tp_size
                  + storage_config.tp_rank)

    # ---------------------------------------------------------------- control path

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.logical_anchor = getattr(mem_pool_host, "kv_buffer", True) is None
        if self.logical_anchor:  # DeepSeek-V4: the anchor owns indices, the v2 pools the bytes
            self.namespace = namespace_for(self.storage_config, mem_pool_host, 0,
                                           self.cfg.store.salt)
            logger.info("offload: logical KV anchor (%s): pages live in the v2 pools",
                        type(mem_pool_host).__name__)
            return
        self.pages = PageMap.for_pool(mem_pool_host)
        self.namespace = namespace_for(self.storage_config, mem_pool_host, self.pages.page_bytes,
                                       self.cfg.store.salt)
        self._ns_digest = self.namespace.digest()
        self._make_keys = key_maker(self._ns_digest)
        self.store.register_namespace(self.namespace)
        register_region = getattr(self.store, "register_region", None)
        if register_region is not None:  # dpu: the agent moves pages in and out of this memory
            register_region(mem_pool_host.kv_buffer)
        logger.info("offload: HiCache backend on %s, layout %s, %d-byte pages in %d buffer(s), "
                    "zero copy %s, writer %s", self.cfg.store.path, self.pages.layout,
                    self.pages.page_bytes, max(1, self.pages.buffers_per_page),
                    self.pages.zero_copy, self.is_writer)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        try:
            self.store.close()
        except Exception:
            logger.exception("offload: closing the block store failed")

    def clear(self) -> bool:
        """Delete every block of this rank's namespace (SGLang's clear-storage admin call)."""
        if not self._ns_digest:
            logger.warning("offload: clear before the host pool was registered; nothing deleted")
            return False
        try:
            n = self.store.clear(namespace=self._ns_digest)
            logger.info("offload: cleared %d blocks of namespace %s", n, self._ns_digest.hex())
            return True
        except Exception:
            logger.exception("offload: clear failed")
            return False

    def get_stats(self) -> Any:
        if not self._metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            pgs, bw = self._pgs, self._bw
            self._pgs = {"prefetch": [], "backup": []}
            self._bw = {"prefetch": [], "backup": []}
        return StorageMetrics(prefetch_pgs=pgs["prefetch"], backup_pgs=pgs["backup"],
                              prefetch_bandwidth=bw["prefetch"], backup_bandwidth=bw["backup"])

    # ---------------------------------------------------------------- keys and bookkeeping

    def _keys(self, keys: Sequence[str]) -> list[bytes]:
        return self._make_keys(keys)

    def _record(self, kind: str, n: int, nbytes: int, t0: float, asked: int = 0,
                pool: str = "kv") -> None:
        """Note one prefetch or backup call of n pages of `pool` out of `asked` (SGLang's storage
        metrics, ours, and the bandwidth the worth-it rule uses)."""
        dt = max(time.perf_counter() - t0, 1e-9)
        if kind == "prefetch" and n:
            bw = self.worth.observe(nbytes, dt)
            if self.tm is not None and bw is not None:
                self.tm.read_bandwidth.set(bw)
        if self.tm is not None:
            (self.tm.load_seconds if kind == "prefetch" else
             self.tm.store_seconds).labels(self.transfer_path).observe(dt)
            direction = "read" if kind == "prefetch" else "write"
            self.tm.pool_pages.labels(pool, direction).inc(n)
            self.tm.pool_bytes.labels(pool, direction).inc(nbytes)
            if self._count_agent:
                read = kind == "prefetch"
                count_agent(self.tm, n if read else 0, max(asked - n, 0) if read else 0,
                            nbytes if read else 0, 0 if read else nbytes)
        if not self._metrics or n == 0:
            return
        with self._lock:
            self._pgs[kind].append(n)
            self._bw[kind].append(nbytes / dt / (1 << 30))

    # ---------------------------------------------------------------- zero-copy interface

    @never_raises("batch_exists", lambda *_a, **_k: 0)
    def batch_exists(self, keys: List[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        if self.logical_anchor:
            return 0   # no bytes to verify without the pools (SGLang asks v2 for those)
        return self._worth_loading(leading_hits(self.store, self._keys(keys)))

    def _worth_loading(self, hits: int, page_bytes: int = 0) -> int:
        """The leading hits worth loading (the worth-it rule over pages of `page_bytes`, by default
        the KV page's), counted in the metrics."""
        if hits == 0 or self.pages is None:
            return hits
        n = self.worth.pages_to_load(hits, self.pages.page_size, page_bytes or self.pages.page_bytes)
        if self.tm is not None:
            self.tm.accepted.inc(n)
            if n < hits:
                self.tm.declined.inc(hits - n)
        return n

    @never_raises("batch_set_v1", all_false)
    def batch_set_v1(self, keys: List[str], host_indices: "torch.Tensor",
                     extra_info: HiCacheStorageExtraInfo | None = None) -> List[bool]:
        if self.logical_anchor:   # no KV bytes: SGLang writes the pools through v2
            return [True] * len(keys)
        return self._move(KV, self.pages, self._keys, self.is_writer, keys, host_indices, write=True)

    @never_raises("batch_get_v1", all_false)
    def batch_get_v1(self, keys: List[str], host_indices: "torch.Tensor",
                     extra_info: HiCacheStorageExtraInfo | None = None) -> List[bool]:
        if self.logical_anchor:   # zero bytes to read; the v2 pools decide the hit
            return [True] * len(keys)
        return self._move(KV, self.pages, self._keys, self.is_writer, keys, host_indices, write=False)

    def _move(self, pool: str, pages: PageMap | None, make_keys: Callable[[Sequence[str]], list[bytes]],
              writes: bool, keys: Sequence[str], host_indices: "torch.Tensor | None", write: bool
              ) -> List[bool]:
        """Store (`write`) or load the pages of `pool` at `host_indices` under `keys`: the one data
        path of the v1 and v2 calls. A rank that does not write the pool reports what is stored."""
        if not keys:
            return []
        starts = None if pages is None else page_starts(pages, pool, len(keys), host_indices)
        if pages is None or starts is None:
            return [False] * len(keys)
        bkeys = make_keys(keys)
        if write and not writes:   # MLA replica: the storage writer (rank 0) writes shared pools
            return list(self.store.exists_many(bkeys))
        t0 = time.perf_counter()
        ok = (write_pages if write else read_pages)(self.store, pages, bkeys, starts)
        n = sum(ok)
        self._record("backup" if write else "prefetch", n, n * pages.page_bytes, t0, len(keys),
                     pool=pool)
        return ok

    # ---------------------------------------------------------------- legacy interface

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any | None = None,
            target_sizes: Any | None = None) -> Any:
        out = self.batch_get([key], [target_location] if target_location is not None else None)
        return out[0]

    @never_raises("batch_get", lambda _self, keys, *_a, **_k: [None] * len(keys))
    def batch_get(self, keys: List[str], target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> List[Any]:
        """Read flat pages into `target_locations` (contiguous tensors); None for a miss."""
        import torch

        if target_locations is None:
            if self.mem_pool_host is None:
                return [None] * len(keys)
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        dests: list[list[Buffer]] = []
        for t in target_locations:
            if not t.is_contiguous():
                return [None] * len(keys)
            dests.append([memoryview(t.reshape(-1).view(torch.uint8).numpy())])
        t0 = time.perf_counter()
        ok = self.store.get_many(self._keys(keys), dests)
        n = sum(ok)
        nbytes = sum(memoryview(d[0]).nbytes for d, g in zip(dests, ok) if g)
        self._record("prefetch", n, nbytes, t0, len(keys))
        return [t if g else None for t, g in zip(target_locations, ok)]

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        return self.batch_set([key], [value])

    @never_raises("batch_set", lambda *_a, **_k: False)
    def batch_set(self, keys: List[str], values: Any | None = None,
                  target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> bool:
        """Store flat page tensors; True only if every page is stored."""
        import torch

        if values is None or len(values) != len(keys):
            return False
        bkeys = self._keys(keys)
        if not self.is_writer:
            return all(self.store.exists_many(bkeys))
        blocks: list[list[Buffer]] = [
            [memoryview(v.contiguous().reshape(-1).view(torch.uint8).numpy())] for v in values]
        t0 = time.perf_counter()
        ok = self.store.put_many(bkeys, blocks)
        n = sum(ok)
        self._record("backup", n, n * (memoryview(blocks[0][0]).nbytes if blocks else 0), t0, len(ok))
        return all(ok)
