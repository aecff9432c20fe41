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
`offload.hicache.sidecars`; DeepSeek-V4's anchor holds no bytes: a "logical anchor"). Then, from its storage
threads: `batch_exists` (leading hits), `batch_set_v1` / `batch_get_v1` (pages moved straight
between host-pool memory and the store, no copy), or the legacy `get/set/batch_get/batch_set`
(flat page tensors, `offload.hicache.legacy`). `clear` deletes every namespace of the rank;
`describe_l3_object_layout` answers SGLang's L3 layout handshake (`offload.hicache.l3_layout`).
`close` closes the store. `HICACHE_CAPABILITIES` tells SGLang (patches/0010-0015) what it may
ask beyond the base interface, as it grants Mooncake by name. `take_kv_events` hands SGLang's
KV-event publisher (patches/0016) the L3 events (`DISK` / `EXTERNAL`) of `offload.events`, fed
from `batch_set_v1` and from the tiers themselves (`offload.hicache.events`).

The face: `OffloadStorage` builds the parts on one shared `BackendState` (`state.py`: settings,
store, writer rank, worth-it rule, metrics, the KV `Pool` and the sidecar `Pool`s, events):
`Attach` (`attach.py`), `KvPages` (`kv.py`), `PoolPages` (`sidecars.py`), `Legacy`
(`legacy.py`) and the `Recorder` (`recorder.py`) — plain classes — and delegates each SGLang
call to one of them. Every page of every pool moves through `page_io.move(store, pool, keys,
host_indices, write)`; the pool's key plan and writer flag decide the rest.

Data path: every call returns per-page success; nothing raises into SGLang (each entry point is
guarded once, by `never_raises`, here). A failed or corrupt read is a miss (the store verifies
checksums). MLA: every TP rank reads one shared namespace and only the storage writer writes
(attention-TP rank == DCP rank of every attention-CP shard). Control path (the constructor, the
pool registrations): a bad setting or a pool we cannot serve raises `ConfigError` naming it. The
store is opened by `_open_store(cfg)`, the one place to swap in another tier (tests inject a
`MemoryStore`). How one page travels from SGLang to the disk and back: docs/design/page-walk.md.

Metrics (`offload.metrics`, unless `offload.metrics.enabled: false`): load/store latency, the
path, the worth-it decisions, and per-tier counters read from the store's stats by a watcher
thread; SGLang's own `StorageMetrics` come from `get_stats`. The worth-it rule
(`offload.hicache.worth_it`): `batch_exists` reports the leading hits only if loading them is faster than
recomputing them: the read bandwidth and a hit's fixed cost are measured on this backend's loads, the
prefill speed is configured, estimated, or measured from a miss's query to its write-back.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, List, Sequence

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from offload.config import OffloadConfig
from offload.hicache.attach import Attach
from offload.hicache.contract import SGLANG_KEYS
from offload.hicache.keying import KeyPlan, dp_attention, metrics_rank, model_ranks, storage_writer
from offload.hicache.kv import KvPages
from offload.hicache.layout import PageMap
from offload.hicache.legacy import Legacy
from offload.hicache.pools import Pool, pool_str
from offload.hicache.recorder import Recorder
from offload.hicache.settings import resolve_salt, settings_from_extra
from offload.hicache.sidecars import PoolPages, all_false_v2, empty_result
from offload.hicache.state import BackendState
from offload.hicache.worth_it import WorthIt, cuda_gpu_name, from_config
from offload.keys import Namespace
from offload.metrics import StoreWatch, path_of, serve, tier_metrics
from offload.store.base import BlockStore, all_false, never_raises

if TYPE_CHECKING:
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer, PoolTransferResult

logger = logging.getLogger(__name__)

# The settings are read by `offload.hicache.settings`; callers import these names from here too.
__all__ = ["SGLANG_KEYS", "OffloadStorage", "resolve_salt", "settings_from_extra"]

def _open_store(cfg: OffloadConfig) -> BlockStore:
    """Open the store the settings name (the one factory; tests replace it): the transfer path
    (`offload.transfer.path`, or detection's choice for `auto`: cpu staging into the local
    `DiskStore`, or the DPU agent), tiered over Redis when `offload.redis.url` is set. `launch`
    passes the decided path explicitly, so scheduler processes do not rerun detection."""
    from offload.store.tiered import make_tiered
    from offload.transfer.base import open_path

    return make_tiered(open_path(cfg), cfg.redis)


class OffloadStorage(HiCacheStorage):
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
        cfg = settings_from_extra(extra)
        self.zero_copy_interface = bool(extra.get("interface_v1", 0))
        if not self.zero_copy_interface:
            logger.warning("offload: interface_v1 is not set in the extra config; SGLang will use "
                           "the legacy copying interface")
        store = _open_store(cfg)
        self.state = st = BackendState(
            cfg=cfg, storage_config=storage_config, store=store,
            is_writer=storage_writer(storage_config, dp_attention()),
            worth=from_config(cfg.worth_it, storage_config.model_name or "",
                              storage_config.tp_size, cuda_gpu_name),
            tm=tier_metrics() if cfg.metrics.enabled else None, transfer_path=path_of(store))
        self._recorder = Recorder(st, storage_config.enable_storage_metrics)
        self._attach = Attach(st)
        self._kv = KvPages(st, self._recorder)
        self._pools = PoolPages(st, self._kv, self._recorder)
        self._legacy = Legacy(st, self._kv, self._recorder)
        self.mem_pool_host: Any = None
        self.metrics_port: int | None = None
        self._watch: StoreWatch | None = None
        if st.tm is not None:
            st.tm.set_path(st.transfer_path)
            self._watch = StoreWatch(store, st.tm).start()
            self.metrics_port = serve(cfg.metrics, metrics_rank(storage_config, model_ranks()))

    # ---------------------------------------------------------------- the shared state, read
    # by tools and tests (`backend.store` is the store pages go to; tests replace it)

    @property
    def store(self) -> BlockStore:
        return self.state.store

    @store.setter
    def store(self, store: BlockStore) -> None:
        self.state.store = store

    @property
    def worth(self) -> WorthIt:
        return self.state.worth

    @worth.setter
    def worth(self, worth: WorthIt) -> None:
        self.state.worth = worth

    @property
    def cfg(self) -> OffloadConfig:
        return self.state.cfg

    @property
    def storage_config(self) -> HiCacheStorageConfig:
        return self.state.storage_config

    @property
    def is_writer(self) -> bool:
        return self.state.is_writer

    @property
    def namespace(self) -> Namespace | None:
        return self.state.namespace

    @property
    def pools(self) -> dict[str, Pool]:
        return self.state.pools

    @property
    def pages(self) -> PageMap | None:
        """The KV pool's page map (None before the attach, on a replica or a logical anchor)."""
        return self.state.kv.pages if self.state.kv is not None else None

    @property
    def plan(self) -> KeyPlan | None:
        """The KV key plan (None before the attach and under a logical anchor)."""
        return self.state.kv.plan if self.state.kv is not None else None

    def block_keys(self, page_hashes: Sequence[str]) -> list[bytes]:
        """The KV block keys of SGLang's page hashes."""
        return self.state.kv_keys(page_hashes)

    # ---------------------------------------------------------------- control path (`attach.py`)

    @property
    def storage_writer(self) -> bool:
        """Whether SGLang's controller should back KV pages up on this rank (patches/0014)."""
        return self.state.is_writer

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._attach.kv(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Register one pool of a hybrid stack: at attach (a refusal fails the attach) or later,
        a SIDECAR draft (a refusal is logged and every call for that pool is a miss)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._attach.sidecar(host_pool, pool_str(host_pool_name))

    def on_host_pools_registered(self) -> None:
        self._attach.done()

    def describe_l3_object_layout(self, *, sidecar_pool_specs: Sequence[Any] = (),
                                  swa_trailing_pages: int | None = None,
                                  page_size: int | None = None) -> dict:
        """SGLang's L3 object-layout handshake (`offload.hicache.l3_layout`)."""
        from offload.hicache.l3_layout import describe

        return describe(self.state, sidecar_pool_specs, swa_trailing_pages, page_size)

    def take_kv_events(self) -> list:
        """L3 KV events (DISK / EXTERNAL) since the last call: SGLang's publisher (patches/0016)."""
        events = self.state.events
        return events.take() if events is not None else []

    def get_stats(self) -> Any:
        return self._recorder.take()

    def clear(self) -> bool:
        """Delete every block of this rank's namespaces, KV and every sidecar pool (SGLang's
        clear-storage admin call). False if nothing is registered yet or a tier failed."""
        digests = self.state.namespace_digests()
        if not digests:
            logger.warning("offload: clear before the host pool was registered; nothing deleted")
            return False
        ok, total = True, 0
        for digest in digests:
            try:
                total += self.state.store.clear(namespace=digest)
            except Exception:
                logger.exception("offload: clear of namespace %s failed", digest.hex())
                ok = False
        logger.info("offload: cleared %d blocks of %d namespace(s)", total, len(digests))
        return ok

    def close(self) -> None:
        if self.state.events is not None:
            self.state.events.close()
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        try:
            self.state.store.close()
        except Exception:
            logger.exception("offload: closing the block store failed")

    # ---------------------------------------------------------------- zero copy (`kv.py`)

    @never_raises("batch_exists", lambda *_a, **_k: 0)
    def batch_exists(self, keys: List[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self._kv.exists(keys)

    @never_raises("batch_set_v1", all_false)
    def batch_set_v1(self, keys: List[str], host_indices: "torch.Tensor",
                     extra_info: HiCacheStorageExtraInfo | None = None) -> List[bool]:
        return self._kv.set_v1(keys, host_indices, extra_info.prefix_keys if extra_info else None)

    @never_raises("batch_get_v1", all_false)
    def batch_get_v1(self, keys: List[str], host_indices: "torch.Tensor",
                     extra_info: HiCacheStorageExtraInfo | None = None) -> List[bool]:
        return self._kv.get_v1(keys, host_indices)

    # ---------------------------------------------------------------- pools, v2 (`sidecars.py`)

    @never_raises("batch_exists_v2", empty_result)
    def batch_exists_v2(self, keys: list[str], pool_transfers: list["PoolTransfer"] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None
                        ) -> "PoolTransferResult":
        return self._pools.exists_v2(keys, list(pool_transfers or []))

    @never_raises("batch_get_v2", all_false_v2)
    def batch_get_v2(self, transfers: list["PoolTransfer"],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[Any, list[bool]]:
        return self._pools.move_v2(transfers, write=False)

    @never_raises("batch_set_v2", all_false_v2)
    def batch_set_v2(self, transfers: list["PoolTransfer"],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[Any, list[bool]]:
        return self._pools.move_v2(transfers, write=True)

    # ---------------------------------------------------------------- copying (`legacy.py`)

    @never_raises("exists", lambda *_a, **_k: False)
    def exists(self, key: str) -> bool:
        return self._legacy.exists(key)

    @never_raises("get", lambda *_a, **_k: None)
    def get(self, key: str, target_location: Any | None = None,
            target_sizes: Any | None = None) -> Any:
        locations = [target_location] if target_location is not None else None
        return self._legacy.batch_get([key], locations)[0]

    @never_raises("batch_get", lambda _self, keys, *_a, **_k: [None] * len(keys))
    def batch_get(self, keys: List[str], target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> List[Any]:
        """Read flat pages into `target_locations` (contiguous tensors); None for a miss."""
        return self._legacy.batch_get(keys, target_locations)

    @never_raises("set", lambda *_a, **_k: False)
    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        return self._legacy.batch_set([key], [value])

    @never_raises("batch_set", lambda *_a, **_k: False)
    def batch_set(self, keys: List[str], values: Any | None = None,
                  target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> bool:
        """Store flat page tensors; True only if every page is stored."""
        return self._legacy.batch_set(keys, values)
