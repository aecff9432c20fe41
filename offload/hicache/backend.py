"""The SGLang HiCache L3 storage backend: `OffloadStorage`, a `HiCacheStorage` over a block store.

SGLang loads it through its `dynamic` storage backend:

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "offload", "module_path": "offload.hicache", "class_name": "OffloadStorage",
      "interface_v1": 1, "offload": {"store": {"path": "/nvme/kv", "capacity": "2TiB"}}}'

Lifecycle: SGLang constructs `OffloadStorage(storage_config, kwargs)` in each scheduler process
(settings are validated here; a bad one raises `ConfigError` naming it), then calls
`register_mem_pool_host(host_pool)`, which fixes the key plan (`offload.hicache.keying`: the
namespaces of model, ranks or head groups, MLA, dtype, layout, page size, salt) and the page map
(`offload.hicache.layout`); a layout we cannot map is refused there, and SGLang's page-hash
extension is built or loaded (`offload.hicache.native_hash`: no request pays it). Hybrid stacks
then register their sidecar pools (`register_mem_host_pool_v2`, the v2 interface in
`offload.hicache.pools`; DeepSeek-V4's anchor holds no bytes: a "logical anchor"). Then, from its storage
threads: `batch_exists` (leading hits), `batch_set_v1` / `batch_get_v1` (pages moved straight
between host-pool memory and the store, no copy), or the legacy `get/set/batch_get/batch_set`
(flat page tensors, `offload.hicache.legacy`). `clear` deletes every namespace of the rank;
`describe_l3_object_layout` answers SGLang's L3 layout handshake (`offload.hicache.l3_layout`).
`close` closes the store. `HICACHE_CAPABILITIES` tells SGLang (patches/0010-0015) what it may
ask beyond the base interface, as it grants Mooncake by name. `take_kv_events` hands SGLang's
KV-event publisher (patches/0016) the L3 events (`DISK` / `EXTERNAL`) of `offload.events`, fed
from `batch_set_v1` and from the tiers themselves (`offload.hicache.events`).

Data path: every call returns per-page success; nothing raises into SGLang. A failed or corrupt
read is a miss (the store verifies checksums). MLA: every TP rank reads one shared namespace and
only the storage writer writes (attention-TP rank == DCP rank of every attention-CP shard). The
store is opened by `_open_store(cfg)`, the one place to swap in another tier (tests inject a
`MemoryStore`).

Metrics (`offload.metrics`, unless `offload.metrics.enabled: false`): load/store latency, the
path, the worth-it decisions, and per-tier counters read from the store's stats by a watcher
thread; SGLang's own `StorageMetrics` come from `get_stats`. The worth-it rule
(`offload.hicache.worth_it`): `batch_exists` reports the leading hits only if loading them is faster than
recomputing them: the read bandwidth and a hit's fixed cost are measured on this backend's loads, the
prefill speed is configured, estimated, or measured from a miss's query to its write-back.
"""

from __future__ import annotations

import dataclasses
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
from offload.hicache.events import kv_events_for
from offload.hicache.keying import (
    KeyPlan,
    allocator_only_mla,
    dp_attention,
    group_ok,
    kv_plan,
    metrics_rank,
    model_ranks,
    namespace_for,
    refuse_layout,
    replica_plan,
    storage_writer,
)
from offload.hicache.layout import PageMap
from offload.hicache.legacy import LegacyMixin
from offload.hicache.native_hash import ensure_native_hash
from offload.hicache.page_io import page_starts, read_pages, write_pages
from offload.hicache.pools import KV, Pool, PoolsMixin
from offload.hicache.worth_it import WorthIt, cuda_gpu_name, from_config
from offload.keys import Namespace
from offload.metrics import (
    StoreWatch,
    TierMetrics,
    count_agent,
    counted_by_backend,
    path_of,
    serve,
    tier_metrics,
)
from offload.store.base import BlockStore, all_false, leading, never_raises

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

def settings_from_extra(extra: dict | None) -> OffloadConfig:
    """The `offload:` settings from SGLang's extra config.

    `config_file` (a deployment YAML; its `offload:` section) is the base, and the inline
    `offload` tree overrides keys of it; `store.salt_file` is read into `store.salt`. Raises
    ConfigError naming every bad key (or an unreadable / non-private salt file).
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
    return resolve_salt(load_offload(_merge(tree, inline or {})))   # store.salt_file read here


def resolve_salt(cfg: OffloadConfig) -> OffloadConfig:
    """`cfg` with `store.salt` read from `store.salt_file` (mode 600, by the one secret-file
    loader) when that is set. Raises ConfigError naming the file."""
    if not cfg.store.salt_file:
        return cfg
    from offload.secret import read_secret_file

    salt = read_secret_file(cfg.store.salt_file, "offload.store.salt_file", min_bytes=1)
    store = dataclasses.replace(cfg.store, salt=salt.decode("utf-8", "replace"), salt_file=None)
    return dataclasses.replace(cfg, store=store)


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


class OffloadStorage(PoolsMixin, LegacyMixin, HiCacheStorage):
    """SGLang HiCache storage backend over an `offload` block store (see the module docstring)."""

    # What SGLang may ask of this backend beyond the base interface; read from the class, before
    # construction, by the capability gates of patches/0010-0015 (`has_capability`).
    HICACHE_CAPABILITIES = frozenset({
        "zero_copy_v1",            # batch_get_v1 / batch_set_v1 by host page index
        "rank_sharded_draft",      # MHA draft pools of an MLA model, written by every TP rank
        "dcp",                     # decode context parallel shards keyed by (dcp rank, size)
        "l3_object_layout",        # describe_l3_object_layout (the L3 layout handshake)
        "storage_writer",          # decides its own writer ranks (attention-CP shards)
        "mla_host_dedup",          # allocator-only MLA host pools on non-source ranks
    })

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        extra = dict(storage_config.extra_config or {})
        extra.update(kwargs or {})
        self.cfg = settings_from_extra(extra)
        self.storage_config = storage_config
        self.zero_copy_interface = bool(extra.get("interface_v1", 0))
        if not self.zero_copy_interface:
            logger.warning("offload: interface_v1 is not set in the extra config; SGLang will use "
                           "the legacy copying interface")
        self.is_writer = storage_writer(storage_config, dp_attention())
        self.store: BlockStore = _open_store(self.cfg)
        self.mem_pool_host: Any = None
        self.pages: PageMap | None = None
        self.namespace: Namespace | None = None
        self.plan: KeyPlan | None = None
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
        self.metrics_port: int | None = None
        self._watch: StoreWatch | None = None
        self.kv_events: Any = None   # offload.events.L3Events, made at register_mem_pool_host
        if self.cfg.metrics.enabled:
            self.tm = tier_metrics()
            self.tm.set_path(self.transfer_path)
            self._watch = StoreWatch(self.store, self.tm).start()
            self.metrics_port = serve(self.cfg.metrics,
                                      metrics_rank(storage_config, model_ranks()))

    # ---------------------------------------------------------------- control path

    @property
    def storage_writer(self) -> bool:
        """Whether SGLang's controller should back KV pages up on this rank (patches/0014)."""
        return self.is_writer

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        refused = refuse_layout(mem_pool_host)
        if refused is not None:
            raise refused
        ensure_native_hash()   # SGLang's page hashes: built / loaded now, not by the first request
        if allocator_only_mla(mem_pool_host):   # MLA host dedup: rank 0 holds the bytes
            self.plan = replica_plan(self.storage_config, mem_pool_host, self.cfg.store.salt)
            self.namespace = self.plan.namespaces[0]
            self.store.register_namespace(self.namespace)
            logger.info("offload: allocator-only MLA host pool (host dedup): this rank reports "
                        "the blocks the source rank stores, and moves no bytes")
            return
        self.logical_anchor = getattr(mem_pool_host, "kv_buffer", True) is None
        if self.logical_anchor:  # DeepSeek-V4: the anchor owns indices, the v2 pools the bytes
            self.namespace = namespace_for(self.storage_config, mem_pool_host, 0,
                                           self.cfg.store.salt)
            logger.info("offload: logical KV anchor (%s): pages live in the v2 pools",
                        type(mem_pool_host).__name__)
            return
        self.pages = PageMap.for_pool(mem_pool_host)
        self.plan = kv_plan(self.storage_config, mem_pool_host, self.pages, self.cfg.store.salt)
        self.namespace = self.plan.namespaces[0]
        for ns in self.plan.namespaces:
            self.store.register_namespace(ns)
        self.kv_events = kv_events_for(self, int(mem_pool_host.page_size))
        register_region = getattr(self.store, "register_region", None)
        if register_region is not None:  # dpu: the agent moves pages in and out of this memory
            register_region(mem_pool_host.kv_buffer)
        logger.info("offload: HiCache backend on %s, layout %s, %d-byte pages in %d buffer(s), "
                    "%d object(s) per page, zero copy %s, writer %s", ", ".join(self.cfg.store.directories()),
                    self.pages.layout, self.pages.page_bytes, max(1, self.pages.buffers_per_page),
                    self.plan.split, self.pages.zero_copy, self.is_writer)

    def describe_l3_object_layout(self, *, sidecar_pool_specs: Sequence[Any] = (),
                                  swa_trailing_pages: int | None = None,
                                  page_size: int | None = None) -> dict:
        """SGLang's L3 object-layout handshake (`offload.hicache.l3_layout`)."""
        from offload.hicache.l3_layout import describe

        return describe(self, sidecar_pool_specs, swa_trailing_pages, page_size)

    def take_kv_events(self) -> list:
        """L3 KV events (DISK / EXTERNAL) since the last call: SGLang's publisher (patches/0016)."""
        return self.kv_events.take() if self.kv_events is not None else []

    def close(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        try:
            self.store.close()
        except Exception:
            logger.exception("offload: closing the block store failed")

    def namespace_digests(self) -> list[bytes]:
        """Every namespace this rank's blocks live in: the KV objects and every sidecar pool."""
        kv = self.plan.digests if self.plan is not None else []
        return kv + [p.digest for p in self.pools.values()]

    def clear(self) -> bool:
        """Delete every block of this rank's namespaces, KV and every sidecar pool (SGLang's
        clear-storage admin call). False if nothing is registered yet or a tier failed."""
        digests = self.namespace_digests()
        if not digests:
            logger.warning("offload: clear before the host pool was registered; nothing deleted")
            return False
        ok, total = True, 0
        for digest in digests:
            try:
                total += self.store.clear(namespace=digest)
            except Exception:
                logger.exception("offload: clear of namespace %s failed", digest.hex())
                ok = False
        logger.info("offload: cleared %d blocks of %d namespace(s)", total, len(digests))
        return ok

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
        return self.plan.keys(keys) if self.plan is not None else []

    def _split(self) -> int:
        return self.plan.split if self.plan is not None else 1

    def _present(self, bkeys: Sequence[bytes], split: int = 1) -> list[bool]:
        """Per page: all its objects are stored."""
        return group_ok(self.store.exists_many(bkeys), split)

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
            if kind == "prefetch" and pool == "kv" and self.pages is not None:
                self.tm.loaded(self.transfer_path, n, dt, self.pages.index_step,
                               self.worth.prefill_tps)
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
        hits = self._kv_hits(keys)
        n = self._worth_loading(hits)
        if self.pages is not None:     # what the rule measures: a miss's prefill, a hit's cost
            self.worth.note_query(keys, hits, n, self.pages.index_step, self.pages.page_bytes)
        return n

    def _kv_hits(self, keys: Sequence[str]) -> int:
        """The leading run of KV pages all of whose objects are stored."""
        return leading(self._present(self._keys(keys), self._split()))

    def _worth_loading(self, hits: int, page_bytes: int = 0) -> int:
        """The leading hits worth loading (the worth-it rule over pages of `page_bytes`, by default
        the KV page's), counted in the metrics."""
        if hits == 0 or self.pages is None:
            return hits
        n = self.worth.pages_to_load(hits, self.pages.index_step, page_bytes or self.pages.page_bytes)
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
        ok = self._move(KV, self.pages, self._keys, self.is_writer, keys, host_indices, write=True,
                        split=self.plan)
        self.worth.note_stored(keys)
        if self.kv_events is not None and self.is_writer:
            self.kv_events.stored(keys, ok, extra_info.prefix_keys if extra_info else None)
        return ok

    @never_raises("batch_get_v1", all_false)
    def batch_get_v1(self, keys: List[str], host_indices: "torch.Tensor",
                     extra_info: HiCacheStorageExtraInfo | None = None) -> List[bool]:
        if self.logical_anchor:   # zero bytes to read; the v2 pools decide the hit
            return [True] * len(keys)
        ok = self._move(KV, self.pages, self._keys, self.is_writer, keys, host_indices,
                        write=False, split=self.plan)
        self.worth.note_loaded(keys, self.pages.page_bytes if self.pages is not None else 0)
        return ok

    def _move(self, pool: str, pages: PageMap | None, make_keys: Callable[[Sequence[str]], list[bytes]],
              writes: bool, keys: Sequence[str], host_indices: "torch.Tensor | None", write: bool,
              split: KeyPlan | None = None) -> List[bool]:
        """Store (`write`) or load the pages of `pool` at `host_indices` under `keys`: the one data
        path of the v1 and v2 calls. A rank that does not write the pool reports what is stored.
        `split`: the KV key plan (objects per page)."""
        if not keys:
            return []
        if pool == KV and self.pages is None and self.plan is not None:
            return self._present(make_keys(keys))   # allocator-only replica: rank 0's blocks
        starts = None if pages is None else page_starts(pages, pool, len(keys), host_indices)
        if pages is None or starts is None:
            return [False] * len(keys)
        bkeys = make_keys(keys)
        if write and not writes:   # MLA replica: the storage writer (rank 0) writes shared pools
            return self._present(bkeys, split.split if split is not None else 1)
        t0 = time.perf_counter()
        ok = (write_pages if write else read_pages)(self.store, pages, bkeys, starts, split)
        n = sum(ok)
        self._record("backup" if write else "prefetch", n, n * pages.page_bytes, t0, len(keys),
                     pool=pool)
        return ok
