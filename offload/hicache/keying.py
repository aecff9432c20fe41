"""Which blocks hold a rank's pages: namespaces named by what a block HOLDS, not who wrote it.

Primitives (control path, pure functions of SGLang's `HiCacheStorageConfig` and the host pool):
- `namespace_for(sc, host_pool, page_bytes, salt)`: the namespace of one rank's KV pages.
- `kv_plan(sc, host_pool, pages, salt)` -> `KeyPlan`: this rank's KV objects. One object per page
  normally; with SGLang's `tp_lcm_size` / `should_split_heads` (the `page_head` layout, MHA) one
  object per head group of `total heads / tp_lcm_size` heads, in absolute group order, so a TP2
  and a TP4 replica key the same heads identically (Mooncake's lcm-rank keys, SGLang's unified
  scheme's `_H{head_group}` coordinate). `KeyPlan.keys(page_hashes)` gives the block keys,
  page-major / group-minor; `KeyPlan.blocks(chunks)` cuts one page's buffers into its objects.
  `KeyPlan.single(ns)`: one object per page (every sidecar pool).
- `replica_plan(sc, host_pool, salt)`: the plan of an allocator-only MLA pool (MLA host dedup's
  non-source ranks: no buffer; `allocator_only_mla(pool)` tells one).
- `storage_writer(sc, dp_attention)`: whether this rank writes the KV pages (see below).
- `metrics_rank(sc, model_ranks())`: the rank that offsets the metrics port, distinct on a host.
- `refuse_layout(host_pool)`: a `ConfigError` for a host layout we cannot serve, else None.
- `group_ok`: per-page flags from per-object flags (the leading run of hits: `store.base.leading`).

Writers: SGLang's `is_storage_writer` is TP rank == DCP rank for MLA. Without DP attention that
TP rank is global, so under attention context parallelism (each CP rank holds a disjoint slice of
every page, and the namespace carries the CP rank) only CP shard 0 would ever be written. Here the
writer is attention-TP rank == DCP rank inside every CP shard (patches/0014 lets SGLang's
controller ask the backend). Head-split (lcm) keys need `page_head`, a zero-copy pool and heads
divisible by the split; anything else is refused at attach.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from offload.errors import ConfigError
from offload.hicache.layout import PageMap
from offload.keys import Namespace, key_maker
from offload.store.base import Buffer

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

# Host layouts whose pages `PageMap` maps; SGLang's other choices are refused at attach.
SERVED_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def namespace_for(sc: "HiCacheStorageConfig", host_pool: Any, page_bytes: int, salt: str,
                  head_group: tuple[int, int] | None = None) -> Namespace:
    """The block namespace of one rank's host pool (or of head group (g, G) of it).

    MLA KV is the same on every TP rank: all ranks share the namespace of rank 0 of a 1-rank
    group. MHA: the namespace names the head group the block holds; with no split that is
    (tp_rank, tp_size), the keys every earlier release wrote. Everything else that changes a
    page's bytes goes into `extra`.
    """
    mla = bool(sc.is_mla_model)
    extra = (f"pool={type(host_pool).__name__};layers={getattr(host_pool, 'layer_num', '')};"
             f"page_bytes={page_bytes};cp={sc.attn_cp_rank}/{sc.attn_cp_size}")
    if sc.dcp_size > 1:
        extra += f";dcp={sc.dcp_rank}/{sc.dcp_size};page={sc.logical_page_size}"
    group, groups = head_group or (sc.tp_rank, sc.tp_size)
    return Namespace(
        model=sc.model_name or "", dtype=_dtype_name(host_pool.dtype),
        layout=str(host_pool.layout), page_size=int(host_pool.page_size),
        tp_rank=0 if mla else group, tp_size=1 if mla else groups,
        pp_rank=sc.pp_rank, pp_size=sc.pp_size, mla=mla, salt=salt, extra=extra)


def head_split(sc: "HiCacheStorageConfig") -> int:
    """Objects per page of this rank: tp_lcm_size / tp_size when SGLang splits heads, else 1."""
    if not sc.should_split_heads or not sc.tp_lcm_size:
        return 1
    return int(sc.tp_lcm_size) // int(sc.tp_size)


@dataclass
class KeyPlan:
    """This rank's KV objects: `split` per page, one namespace each (see the module docstring)."""

    namespaces: list[Namespace]
    split: int
    makers: list[Callable[[Sequence[str]], list[bytes]]]

    @classmethod
    def single(cls, ns: Namespace) -> "KeyPlan":
        """One object per page, in namespace `ns` (every sidecar pool; KV without a head split)."""
        return cls([ns], 1, [key_maker(ns.digest())])

    @property
    def digests(self) -> list[bytes]:
        return [ns.digest() for ns in self.namespaces]

    @property
    def head_groups(self) -> list[int]:
        """The absolute head group of each object (SGLang's unified-scheme `_H{g}`); MLA: [0]."""
        return [ns.tp_rank for ns in self.namespaces]

    def keys(self, page_hashes: Sequence[str]) -> list[bytes]:
        """Block keys, page-major / head-group-minor (`split` per page)."""
        if self.split == 1:
            return self.makers[0](page_hashes)
        per = [m(page_hashes) for m in self.makers]
        return [per[g][i] for i in range(len(page_hashes)) for g in range(self.split)]

    def blocks(self, chunks: Sequence[memoryview]) -> list[list[Buffer]]:
        """The buffers of each object of one page, from the page's chunks (`PageMap.buffers`,
        or a flat page cut into its K and V halves)."""
        if self.split == 1:
            return [list(chunks)]
        out: list[list[Buffer]] = []
        for g in range(self.split):
            unit: list[Buffer] = []
            for mv in chunks:   # each chunk is head-major (page_head): group g is its g-th slice
                n = mv.nbytes // self.split
                unit.append(mv[g * n:(g + 1) * n])
            out.append(unit)
        return out


def kv_plan(sc: "HiCacheStorageConfig", host_pool: Any, pages: PageMap, salt: str) -> KeyPlan:
    """This rank's KV key plan; raises ConfigError for a head split it cannot honour."""
    split = head_split(sc)
    if split == 1:
        return KeyPlan.single(namespace_for(sc, host_pool, pages.page_bytes, salt))
    heads = int(getattr(host_pool, "head_num", 0) or 0)
    problems = []
    if str(host_pool.layout) != "page_head":
        problems.append(f"layout {host_pool.layout!r} (head-split keys need page_head)")
    if not pages.zero_copy or pages.buffers_per_page != 2:
        problems.append("a host pool that is not one contiguous CPU tensor with K and V halves")
    if heads <= 0 or heads % split:
        problems.append(f"{heads} KV heads per rank, not divisible by the split {split}")
    if pages.page_bytes % split:
        problems.append(f"{pages.page_bytes}-byte pages, not divisible by the split {split}")
    if problems:
        raise ConfigError([f"hicache-storage-backend-extra-config.tp_lcm_size: "
                           f"{sc.tp_lcm_size} at TP {sc.tp_size} splits each page into {split} "
                           f"head groups, which this host pool cannot serve: {p}; fix: use "
                           "--hicache-mem-layout page_head on an MHA model, or drop tp_lcm_size"
                           for p in problems])
    groups = int(sc.tp_lcm_size or 0)
    nss = [namespace_for(sc, host_pool, pages.page_bytes // split, salt,
                         head_group=(sc.tp_rank * split + g, groups)) for g in range(split)]
    return KeyPlan(nss, split, [key_maker(ns.digest()) for ns in nss])


def allocator_only_mla(host_pool: Any) -> bool:
    """An MLA host pool without a buffer: the non-source ranks of SGLang's MLA host dedup (an
    `MLAHostAllocation` pool; the source rank loads the pages and broadcasts them)."""
    if getattr(host_pool, "kv_buffer", True) is not None:
        return False
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    return isinstance(host_pool, MLATokenToKVPoolHost)


def replica_plan(sc: "HiCacheStorageConfig", host_pool: Any, salt: str) -> KeyPlan:
    """The key plan of an allocator-only MLA replica: the shared MLA namespace, its page bytes
    from the pool's geometry (the writer's `PageMap` gives the same). Raises ConfigError when
    this rank would have to write (it holds no bytes)."""
    if not sc.is_mla_model or storage_writer(sc, dp_attention()):
        raise ConfigError([f"offload: the KV host pool {type(host_pool).__name__} of TP rank "
                           f"{sc.tp_rank} has no buffer, but this rank is the storage writer; "
                           "fix: MLA host dedup must keep the buffer on the source rank 0"])
    page_bytes = int(host_pool.get_size_per_token()) * int(host_pool.page_size)
    return KeyPlan.single(namespace_for(sc, host_pool, page_bytes, salt))


def group_ok(flags: Sequence[bool], split: int) -> list[bool]:
    """Per-page success from per-object success (a page needs all its `split` objects)."""
    if split == 1:
        return list(flags)
    return [all(flags[i:i + split]) for i in range(0, len(flags), split)]


def storage_writer(sc: "HiCacheStorageConfig", dp_attention: bool) -> bool:
    """Whether this rank writes its KV pages: every MHA rank; for MLA the attention-TP rank equal
    to the DCP rank of every attention-CP shard (SGLang's own rule writes CP shard 0 only)."""
    if not sc.is_mla_model:
        return True
    attn_tp_size = sc.tp_size
    if sc.attn_cp_size > 1 and not dp_attention and sc.tp_size % sc.attn_cp_size == 0:
        attn_tp_size = sc.tp_size // sc.attn_cp_size   # tp_rank = cp_rank * attn_tp + attn_tp_rank
    return sc.tp_rank % max(attn_tp_size, 1) == sc.dcp_rank


def metrics_rank(sc: "HiCacheStorageConfig", world: tuple[int, int, int] | None) -> int:
    """Offset of this process's metrics port. `world`: (pp_rank, tp_size, tp_rank) of the whole
    model (SGLang's `get_parallel()`: with DP attention `sc.tp_rank` is local to the attention
    group, so every group would get the same port). Without it: DP groups spread by `dp_rank`."""
    if world is not None:
        pp_rank, tp_size, tp_rank = world
        return pp_rank * tp_size + tp_rank
    return (sc.dp_rank * sc.pp_size + sc.pp_rank) * sc.tp_size + sc.tp_rank


def refuse_layout(host_pool: Any, what: str = "KV host pool") -> ConfigError | None:
    """A clear refusal for a host layout whose pages we cannot map (e.g. Ascend's
    `page_first_kv_split`, K and V in separate buffers), else None."""
    layout = str(getattr(host_pool, "layout", ""))
    if layout in SERVED_LAYOUTS:
        return None
    return ConfigError([f"--hicache-mem-layout: {layout!r} ({what} {type(host_pool).__name__}) "
                        "is not served by the offload L3 tier; allowed: "
                        f"{', '.join(SERVED_LAYOUTS)} (page_head for MHA only); fix: pick one "
                        "of them, or run this deployment without --hicache-storage-backend"])


def dp_attention() -> bool:
    """Whether SGLang runs DP attention (storage TP ranks are then attention-group local)."""
    try:
        from sglang.srt.layers.dp_attention import is_dp_attention_enabled

        return bool(is_dp_attention_enabled())
    except Exception:  # noqa: BLE001 - no published server config (tools, tests): no DP attention
        return False


def model_ranks() -> tuple[int, int, int] | None:
    """(pp_rank, tp_size, tp_rank) of the whole model from SGLang's runtime, if published."""
    try:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        return int(p.pp_rank), int(p.tp_size), int(p.tp_rank)
    except Exception:  # noqa: BLE001 - no published server config: fall back to the storage config
        return None
