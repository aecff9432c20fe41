"""SGLang's v2 (pool) storage interface: sidecar pools as namespaces of the one block store.

SGLang 0.5.23's hybrid stacks register host pools beside the KV anchor (`PoolName`: DRAFT,
INDEXER, MAMBA, SWA, DEEPSEEK_V4_*) and move them with `batch_exists_v2 / batch_get_v2 /
batch_set_v2`. Here every pool is its own `Namespace` (pool name, host pool class, dtype, page
bytes, layers, page size, plus everything of the KV namespace), so a pool's page is a block like
any other and every tier (disk, dpu agent, Redis) carries it without knowing about pools.

Primitives:
- `pool_namespace(kv_ns, name, host_pool, page_bytes, per_rank, tp)`: a pool's identity.
- `Pool`: one registered host pool (its `PageMap`, namespace digest, key maker, whether this
  rank writes it). `build_pool(...)` lays it out or raises `ConfigError` naming the pool and the
  model family (the attach fails closed).
- `restorable(kv_pages, transfers, present)`: the hit policies (ALL_PAGES, TRAILING_PAGES,
  BLOCK_GROUPS) as one pure function -> (restorable prefix lengths, per-pool hit pages).
- `PoolsMixin`: the v2 methods of `OffloadStorage` (register, exists, get, set), data path
  guarded by `never_raises`.

Sharing: MAMBA state is per TP rank; every other pool follows KV's MLA sharing (one namespace
for all ranks of an MLA model, written by the storage writer), except a pool of an MHA host class
on an MLA model (an EAGLE3 draft on DeepSeek / Kimi: its heads are sharded per rank): per rank
too, written by every rank (SGLang's controller asks every rank for it with patches/0011, as it
does for Mooncake; refused at attach at TP > 1 by an SGLang without that patch). Non-writer MLA
ranks really write their per-rank pools. A refusal at attach fails the attach; a pool registered
later (a sidecar added at run time) that cannot be stored is logged and every call for it is a
miss, so nothing raises into SGLang. Nothing is inferred: a pool's page is present only if its
own block is, and `batch_get_v2` says True only for blocks fully read and checksum-verified.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from offload.errors import ConfigError
from offload.hicache.keying import SERVED_LAYOUTS, KeyPlan
from offload.hicache.layout import PageMap
from offload.keys import Namespace, key_maker
from offload.store.base import BlockStore, never_raises

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolTransfer,
        PoolTransferResult,
    )

    from offload.hicache.worth_it import WorthIt

logger = logging.getLogger(__name__)

KV = "kv"
MAMBA = "mamba"

# pool-name prefix -> the model family that sends it (for messages, docs and the benchmark)
FAMILIES = (
    ("deepseek_v4", "DeepSeek-V4 (compressed pools)"),
    ("draft_indexer", "speculative draft of a DSA/NSA model"),
    ("draft_swa", "speculative draft of an SWA hybrid"),
    ("draft", "speculative decoding (EAGLE / EAGLE3 / standalone draft)"),
    ("indexer", "DSA/NSA sparse attention (DeepSeek-V3.2, GLM-5)"),
    ("mamba", "Mamba / GDN / KDA hybrid (Qwen3-Next, Kimi-Linear)"),
    ("auxiliary_swa", "SWA hybrid (auxiliary window)"),
    ("swa", "SWA hybrid (gpt-oss, Gemma)"),
    ("kv", "full-attention KV"),
)


def pool_str(name: Any) -> str:
    """A `PoolName` (a str enum) or plain string as its value."""
    return str(getattr(name, "value", name))


def family_of(name: str) -> str:
    return next((f for prefix, f in FAMILIES if name.startswith(prefix)), f"pool {name!r}")


def pool_namespace(kv_ns: Namespace, name: str, host_pool: Any, page_bytes: int, per_rank: bool,
                   tp: tuple[int, int]) -> Namespace:
    """The namespace of one sidecar pool: the KV namespace's fields plus the pool's own."""
    extra = (f"{kv_ns.extra};pool_class={type(host_pool).__name__};"
             f"pool_layers={getattr(host_pool, 'layer_num', '')};pool_page_bytes={page_bytes}")
    tp_rank, tp_size = tp if per_rank else (kv_ns.tp_rank, kv_ns.tp_size)
    return replace(kv_ns, pool=name, dtype=str(getattr(host_pool, "dtype", "")).removeprefix(
        "torch."), layout=str(getattr(host_pool, "layout", "")),
        page_size=int(host_pool.page_size), tp_rank=tp_rank, tp_size=tp_size, extra=extra)


@dataclass
class Pool:
    """One registered host pool (see the module docstring)."""

    name: str
    host: Any
    pages: PageMap
    digest: bytes
    keys: Callable[[Sequence[str]], list[bytes]]
    writes: bool                   # this rank writes the pool's blocks

    @property
    def page_size(self) -> int:
        return self.pages.page_size

    @property
    def page_bytes(self) -> int:
        return self.pages.page_bytes


def _per_rank(name: str, host_pool: Any, mla: bool) -> bool:
    return name == MAMBA or (mla and type(host_pool).__name__.startswith("MHA"))


def sglang_backs_up_sharded_drafts() -> bool:
    """Whether the installed SGLang asks every TP rank for a rank-sharded draft pool of a backend
    declaring `rank_sharded_draft` (patches/0011)."""
    import inspect

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    return "rank_sharded_draft" in inspect.getsource(HybridCacheController.should_backup)


def build_pool(name: str, host_pool: Any, kv_ns: Namespace, sc: "HiCacheStorageConfig",
               is_writer: bool) -> tuple[Pool, Namespace]:
    """Lay one sidecar pool out (control path). Raises ConfigError naming the pool and family."""
    fam = family_of(name)

    def refuse(why: str) -> ConfigError:
        return ConfigError([f"offload: pool {name!r} ({type(host_pool).__name__}) of a {fam} "
                            f"model cannot be stored: {why}"])

    mla = bool(sc.is_mla_model)
    per_rank = _per_rank(name, host_pool, mla)
    if per_rank and name != MAMBA and sc.tp_size > 1 and not sglang_backs_up_sharded_drafts():
        raise refuse(f"its pages are sharded across the {sc.tp_size} TP ranks of an MLA model, "
                     "and this SGLang backs such a pool up only on the MLA writer rank "
                     "(HybridCacheController.should_backup without patches/0011), so other ranks "
                     "could never restore it; fix: install sglang-offload's patched SGLang, or "
                     "run with TP 1 or without the L3 tier")
    layout = str(getattr(host_pool, "layout", ""))
    if layout not in SERVED_LAYOUTS:
        raise refuse(f"host layout {layout!r}; allowed: {', '.join(SERVED_LAYOUTS)}")
    page_size = int(getattr(host_pool, "page_size", 0) or 0)
    if page_size <= 0:
        raise refuse(f"page size {page_size!r}")
    try:
        pages = PageMap.for_pool(host_pool)
    except Exception as e:  # noqa: BLE001 - any layout failure is a refusal naming the pool
        raise refuse(f"its pages cannot be laid out ({type(e).__name__}: {e})") from None
    if pages.page_bytes <= 0 or pages.page_num < 1:
        raise refuse(f"{pages.page_bytes}-byte pages, {pages.page_num} pages")
    ns = pool_namespace(kv_ns, name, host_pool, pages.page_bytes, per_rank,
                        (sc.tp_rank, sc.tp_size))
    digest = ns.digest()
    return Pool(name=name, host=host_pool, pages=pages, digest=digest, keys=key_maker(digest),
                writes=is_writer or per_rank), ns


def restorable(kv_pages: int, transfers: Iterable[Any], present: Mapping[str, Sequence[bool]]
               ) -> tuple[list[int], dict[str, int]]:
    """SGLang's hit policies over the pools' presence under the KV keys [0, kv_pages).

    Returns (restorable prefix lengths, ascending; pool name -> hit pages), exactly as SGLang's
    `HiCacheFile.batch_exists_v2` computes them for ALL_PAGES and TRAILING_PAGES. BLOCK_GROUPS
    (no 0.5.23 caller sends it; `HiCacheFile` raises on it): the pages covered by the leading
    complete groups of `group_pages` keys, reported as the pool's own verdict, never a gate.
    """
    hits: dict[str, int] = {}
    rest = list(range(1, kv_pages + 1))
    for t in transfers:
        if not rest:
            break
        name = pool_str(t.name)
        have = present[name]
        policy = pool_str(t.hit_policy)
        if policy == "block_groups":
            group = int(getattr(t, "group_pages", 0) or 0)
            done = 0
            while group > 0 and done + group <= kv_pages and all(have[done:done + group]):
                done += group
            if done:
                hits[t.name] = done
            continue
        if policy == "trailing_pages":
            trailing = max(1, len(t.keys) if t.keys else 1)
            ok = {n for n in range(1, kv_pages + 1) if all(have[max(0, n - trailing):n])}
        else:  # all_pages
            first_gap = next((i for i in range(kv_pages) if not have[i]), kv_pages)
            ok = set(range(1, first_gap + 1))
        boundary = max(ok, default=0)
        if boundary:
            hits[t.name] = boundary
        rest = [p for p in rest if p in ok]
    return rest, hits


def _empty_result(*_: Any, **__: Any) -> "PoolTransferResult":
    from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

    return PoolTransferResult(0, {}, [])


def _all_false(_self: Any, transfers: Sequence[Any], *_: Any, **__: Any) -> dict[Any, list[bool]]:
    return {t.name: [False] * len(t.keys or []) for t in transfers}


class PoolsMixin:
    """The v2 methods of `OffloadStorage`; it provides the attributes declared here."""

    store: BlockStore
    storage_config: "HiCacheStorageConfig"
    is_writer: bool
    namespace: Namespace | None
    pages: PageMap | None
    plan: KeyPlan | None
    worth: "WorthIt"
    logical_anchor: bool
    pools: dict[str, Pool]
    _pools_attached: bool = False
    _keys: Callable[[Sequence[str]], list[bytes]]
    _kv_hits: Callable[[Sequence[str]], int]
    _move: Callable[..., list[bool]]
    _worth_loading: Callable[[int, int], int]

    # ------------------------------------------------------------ control path

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Register one pool of a hybrid stack: at attach (a refusal fails the attach) or later,
        a SIDECAR draft (a refusal is logged and every call for that pool is a miss)."""
        name = pool_str(host_pool_name)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)  # type: ignore[misc]
        if name == KV or host_pool is getattr(self, "mem_pool_host", None):
            return   # the anchor: v1 pages (`register_mem_pool_host`)
        try:
            if self.namespace is None:
                raise ConfigError([f"offload: pool {name!r} registered before the KV host pool"])
            pool, ns = build_pool(name, host_pool, self.namespace, self.storage_config,
                                  self.is_writer)
        except ConfigError as e:
            if not self._pools_attached:
                raise
            logger.error("offload: pool %s registered at run time is not stored (every call "
                         "for it is a miss): %s", name, e)
            return
        self.store.register_namespace(ns)
        if pool.pages.zero_copy:
            register_region = getattr(self.store, "register_region", None)
            if register_region is not None:
                register_region(host_pool.kv_buffer)
        self.pools[name] = pool
        logger.info("offload: pool %s (%s, %s): %d-byte pages of %d tokens, %s, written by %s",
                    name, type(host_pool).__name__, family_of(name), pool.page_bytes,
                    pool.page_size, "per TP rank" if ns.tp_size > 1 or name == MAMBA else "shared",
                    "this rank" if pool.writes else "the MLA writer rank")

    def on_host_pools_registered(self) -> None:
        self._pools_attached = True
        logger.info("offload: host pools registered: %s", ", ".join(self.pools) or "KV only")

    # ------------------------------------------------------------ data path

    @never_raises("batch_exists_v2", _empty_result)
    def batch_exists_v2(self, keys: list[str], pool_transfers: list["PoolTransfer"] | None = None,
                        extra_info: "HiCacheStorageExtraInfo | None" = None
                        ) -> "PoolTransferResult":
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        transfers = list(pool_transfers or [])
        if self.logical_anchor:
            kv_pages = len(keys) if transfers else 0   # the sidecars carry every byte
        else:
            kv_pages = self._kv_hits(keys)
        present: dict[str, list[bool]] = {}
        for t in transfers:
            pool = self.pools.get(pool_str(t.name))
            if pool is None:
                present[pool_str(t.name)] = [False] * kv_pages
            elif pool_str(t.name) not in present:
                present[pool_str(t.name)] = self.store.exists_many(pool.keys(keys[:kv_pages]))
        rest, hits = restorable(kv_pages, transfers, present)
        if kv_pages:
            hits = {KV: kv_pages, **hits}   # the first key is SGLang's PoolName.KV (equal str)
        final = rest[-1] if rest else 0
        cut = self._worth_cut(final, transfers)
        if cut < final:
            rest = [p for p in rest if p <= cut]
            final = rest[-1] if rest else 0
        return PoolTransferResult(final, hits, rest)

    def _worth_cut(self, final: int, transfers: Sequence[Any]) -> int:
        """The worth-it rule over the KV page plus every sidecar loaded with it."""
        if final == 0 or self.pages is None:
            return final
        nbytes = self.pages.page_bytes + sum(
            p.page_bytes for p in (self.pools.get(pool_str(t.name)) for t in transfers)
            if p is not None)
        return self._worth_loading(final, nbytes)

    @never_raises("batch_get_v2", _all_false)
    def batch_get_v2(self, transfers: list["PoolTransfer"],
                     extra_info: "HiCacheStorageExtraInfo | None" = None) -> dict[Any, list[bool]]:
        return {t.name: self._pool_io(t, write=False) for t in transfers}

    @never_raises("batch_set_v2", _all_false)
    def batch_set_v2(self, transfers: list["PoolTransfer"],
                     extra_info: "HiCacheStorageExtraInfo | None" = None) -> dict[Any, list[bool]]:
        return {t.name: self._pool_io(t, write=True) for t in transfers}

    def _pool_io(self, t: "PoolTransfer", write: bool) -> list[bool]:
        keys = list(t.keys or [])
        name = pool_str(t.name)
        if name == KV:
            if self.logical_anchor:
                return [True] * len(keys)
            return self._move(KV, self.pages, self._keys, self.is_writer, keys, t.host_indices, write,
                              split=self.plan)
        pool = self.pools.get(name)
        if pool is None:
            if keys:
                logger.debug("offload: %s of unregistered pool %s", "set" if write else "get", name)
            return [False] * len(keys)
        return self._move(name, pool.pages, pool.keys, pool.writes, keys, t.host_indices, write)
