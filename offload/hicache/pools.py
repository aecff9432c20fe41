"""SGLang's v2 (pool) storage interface: sidecar pools as namespaces of the one block store.

SGLang 0.5.23's hybrid stacks register host pools beside the KV anchor (`PoolName`: DRAFT,
INDEXER, MAMBA, SWA, DEEPSEEK_V4_*) and move them with `batch_exists_v2 / batch_get_v2 /
batch_set_v2`. Here every pool is its own `Namespace` (pool name, host pool class, dtype, page
bytes, layers, page size, plus everything of the KV namespace), so a pool's page is a block like
any other and every tier (disk, dpu agent, Redis) carries it without knowing about pools.

Primitives:
- `pool_namespace(kv_ns, name, host_pool, page_bytes, per_rank, tp)`: a pool's identity.
- `Pool`: one registered host pool, KV included (its `PageMap`, its `KeyPlan`: the objects of a
  page and their keys, whether this rank writes it). `kv_pool(...)` is the KV anchor's;
  `build_pool(...)` lays a sidecar out or raises `ConfigError` naming the pool and the model
  family (the attach fails closed).
- `restorable(kv_pages, transfers, present)`: the hit policies (ALL_PAGES, TRAILING_PAGES,
  BLOCK_GROUPS) as one pure function -> (restorable prefix lengths, per-pool hit pages).
The v2 calls that use them are `offload.hicache.sidecars` (a part of `OffloadStorage`).

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

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from offload.errors import ConfigError
from offload.hicache.keying import SERVED_LAYOUTS, KeyPlan
from offload.hicache.layout import PageMap
from offload.keys import Namespace

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

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
    """One registered host pool, KV or sidecar (see the module docstring).

    `pages` is None only for an allocator-only MLA replica's KV (no bytes on this rank: it
    reports the blocks the source rank stores). `writes`: this rank writes the pool's blocks;
    a rank that does not reports what is stored (`page_io.move`)."""

    name: str
    host: Any
    pages: PageMap | None
    plan: KeyPlan                  # the objects of a page, their namespaces and keys
    writes: bool

    def keys(self, page_hashes: Sequence[str]) -> list[bytes]:
        """The block keys of SGLang's page hashes, `split` per page (page-major)."""
        return self.plan.keys(page_hashes)

    @property
    def split(self) -> int:
        """Objects (blocks) per page: > 1 only for KV head groups."""
        return self.plan.split

    @property
    def digest(self) -> bytes:
        """The namespace digest of the pool's (first) object."""
        return self.plan.digests[0]

    @property
    def page_size(self) -> int:
        return self.pages.page_size if self.pages is not None else 0

    @property
    def page_bytes(self) -> int:
        return self.pages.page_bytes if self.pages is not None else 0


def kv_pool(host_pool: Any, pages: PageMap | None, plan: KeyPlan, is_writer: bool) -> Pool:
    """The KV anchor as a pool: its key plan (head groups, or a replica's shared namespace)."""
    return Pool(name=KV, host=host_pool, pages=pages, plan=plan, writes=is_writer)


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
    return Pool(name=name, host=host_pool, pages=pages, plan=KeyPlan.single(ns),
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
