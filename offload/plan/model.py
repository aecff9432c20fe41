"""KV-cache sizing from first principles (the model behind `sglang-offload plan`).

Primitives (pure functions; the model comes from `offload.plan.presets.load_architecture`, a
preset or a HuggingFace config.json):
- `kv_bytes_per_token(arch, kv_bytes, tp)`: 2 x layers x KV heads x head dim x bytes, per rank
  (KV heads split across TP ranks, replicated when tp > KV heads); MLA: (kv_lora_rank +
  qk_rope_head_dim) x layers x bytes, one copy, replicated on every rank.
- `make_plan(inputs) -> Plan`: per-user KV, contexts that fit in HBM after the weights, the L2
  host pool (hicache-size / hicache-ratio) and what an L3 hit needs of it, conversations carried
  within a TTFT target with the L2 and the L3 behind HBM (`offload.plan.reload`), tier capacity
  needed, prefix load time vs prefill time, and `problems`: why the deployment cannot run (the
  weights or one context do not fit: the least TP that fits), empty when it can.
- `prefix_times` / `worth_loading`: the load-or-recompute rule, reusable by the backend.
`offload.plan.table` prints a Plan; `offload.plan.deployment` reads one from a deployment file.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from offload.errors import ConfigError
from offload.plan.dtypes import DTYPE_BYTES
from offload.plan.presets import Architecture, GpuPreset
from offload.plan.reload import Carried, TierSpec, carried

GiB = 1 << 30
DEFAULT_MFU = 0.4               # share of dense BF16 peak a long prefill sustains (assumed)
DEFAULT_READ_GBPS = 7.0         # one PCIe Gen4 NVMe drive, sequential read
DEFAULT_MEM_FRACTION = 0.9      # SGLang --mem-fraction-static: (weights + KV pool) / HBM
DEFAULT_L2_GBPS = 50.0          # host -> GPU, pinned memory over one PCIe Gen5 x16 link (assumed)
DEFAULT_L2_RATIO = 2.0          # SGLang's --hicache-ratio when neither it nor hicache-size is set
DEFAULT_THINK_S = 60.0          # a user reads and types between turns (assumed)
DEFAULT_TURN_S = 20.0           # a turn's KV in HBM: its prefill and reply (~1000 tokens, assumed)
DEFAULT_TTFT_S = 2.0            # time to first token a returning user accepts (assumed)
HICACHE_GB = 1e9                # SGLang's --hicache-size unit (GB per GPU)
def kv_heads_per_rank(arch: Architecture, tp: int) -> int:
    """KV heads each TP rank holds: split when tp <= KV heads, one replicated head otherwise."""
    if arch.mla:
        return 1
    if tp <= 0 or (arch.kv_heads % tp and tp % arch.kv_heads) or arch.attention_heads % tp:
        raise ConfigError([f"--tp {tp} must divide the {arch.attention_heads} attention heads, and "
                           f"divide or be a multiple of the {arch.kv_heads} KV heads of "
                           f"{arch.name}"])
    return max(1, arch.kv_heads // tp)


def kv_bytes_per_token(arch: Architecture, kv_bytes: float, tp: int = 1) -> int:
    """KV bytes one token occupies on one TP rank (MLA: the latent, identical on every rank)."""
    if arch.mla:
        return int((arch.kv_lora_rank + arch.qk_rope_head_dim) * arch.layers * kv_bytes)
    return int(2 * arch.layers * kv_heads_per_rank(arch, tp) * arch.head_dim * kv_bytes)


def prefill_flops_per_token(arch: Architecture, context: int) -> float:
    """2 x active params (matmuls) + causal attention (QK^T and AV over context/2 on average)."""
    per_head = arch.attn_qk_dim + arch.attn_v_dim
    attn = 2 * arch.layers * arch.attention_heads * per_head * context / 2
    return 2.0 * arch.active_params + attn


def prefix_times(prefix_tokens: int, bytes_per_token: float, read_gbps: float,
                 prefill_tokens_per_s: float) -> tuple[float, float]:
    """(seconds to load the prefix's KV at read_gbps GB/s (1e9 B/s), seconds to prefill it)."""
    if read_gbps <= 0 or prefill_tokens_per_s <= 0:
        raise ValueError("read_gbps and prefill_tokens_per_s must be positive")
    return (prefix_tokens * bytes_per_token / (read_gbps * 1e9),
            prefix_tokens / prefill_tokens_per_s)


def worth_loading(prefix_tokens: int, bytes_per_token: float, read_gbps: float,
                  prefill_tokens_per_s: float) -> bool:
    """True when loading the prefix's KV from the tier is faster than recomputing it."""
    load_s, prefill_s = prefix_times(prefix_tokens, bytes_per_token, read_gbps,
                                     prefill_tokens_per_s)
    return load_s < prefill_s




@dataclass(frozen=True)
class PlanInputs:
    arch: Architecture
    gpu: GpuPreset
    context: int = 131072
    kv_dtype: str = "bf16"
    weight_dtype: str = "bf16"
    tp: int = 1
    gpus: int = 1
    gpu_mem: int | None = None           # bytes; None = the GPU preset's memory
    mem_fraction: float = DEFAULT_MEM_FRACTION
    tier_capacity: int | None = None     # bytes of NVMe / Redis for the whole deployment
    target_users: int | None = None      # for tier sizing; None = the conversations carried
    hit_rate: float = 1.0
    prefix_tokens: int | None = None     # None = context
    read_gbps: float = DEFAULT_READ_GBPS  # the tier's read bandwidth per replica (all drives)
    prefill_tps: float | None = None     # per GPU; None = derived from the GPU's FLOPS
    model_source: str = ""
    read_drives: int = 1                 # distinct drives behind read_gbps
    read_source: str = ""                # how read_gbps was found ("4 drives x 7 GB/s")
    page_size: int | None = None         # tokens per page = per stored block; None: not shown
    l2_size: int | None = None           # bytes of host KV pool per GPU (hicache-size)
    l2_ratio: float | None = None        # host pool / HBM KV pool (hicache-ratio)
    l2_gbps: float = DEFAULT_L2_GBPS     # host -> GPU per GPU
    think_s: float = DEFAULT_THINK_S
    turn_s: float = DEFAULT_TURN_S
    ttft_s: float = DEFAULT_TTFT_S
    host_mem: int | None = None          # bytes of host memory the L2 pools of all GPUs share
    host_reserve: int = 0                # of it, what SGLang keeps free (10 GiB in 0.5.23)
    host_mem_source: str = "--host-mem"
    tier_name: str = "L3"                # "L3 NVMe", "L3 DPU agent", "L3 Redis"


@dataclass(frozen=True)
class Users:
    kv_dtype: str
    kv_bytes_per_user: int               # whole model, all ranks (no replication)
    kv_bytes_per_user_per_rank: int
    resident_per_replica: int            # full contexts that fit in HBM at once
    resident: int                        # all replicas
    l2_contexts_per_replica: int         # full contexts the L2 pool holds beyond HBM's copies
    conversations: list[Carried]         # per replica: with the L2, with the L3 behind it
    with_offload: int                    # conversations carried within the TTFT, all replicas
    tier_bytes_per_user: int             # one copy per rank (MLA: one copy)


@dataclass(frozen=True)
class Plan:
    inputs: dict[str, Any]
    kv_bytes_per_token: int              # whole model
    kv_bytes_per_token_per_rank: int
    kv_heads_per_rank: int
    replicas: int
    gpu_mem: int
    static_bytes_per_gpu: int            # gpu_mem x mem_fraction
    weight_bytes_per_gpu: int
    kv_budget_per_gpu: int               # static - weights (negative: the weights do not fit)
    block_bytes_per_gpu: int | None      # one page (K and V, every layer) on one GPU
    l2_bytes_per_gpu: int                # the host KV pool of one GPU
    l2_source: str
    l2_for_l3_hit_bytes_per_gpu: int     # the least host pool that takes one whole L3 hit
    l2_to_carry_bytes_per_gpu: int       # the host pool that keeps every carried context
    pinned_host_bytes: int               # L2 pools of all GPUs
    users: list[Users]                   # the chosen KV dtype first, then FP8 for comparison
    target_users: int
    tier_bytes_needed: int
    tier_users_capacity: int | None
    prefix_tokens: int
    prefix_load_bytes: int
    prefill_tps_per_gpu: float
    prefill_tps_source: str
    prefix_load_s: float
    prefix_prefill_s: float
    worth_loading: bool
    min_tp: int | None                   # the least TP that holds the weights and one context
    problems: list[str]                  # why the deployment cannot run; empty: it can
    warnings: list[str]                  # it runs, but loses something
    assumptions: list[str]
    runnable: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "runnable", not self.problems)


def _check(inp: PlanInputs) -> None:
    problems = []
    if inp.tp < 1 or inp.gpus < 1 or inp.gpus % inp.tp:
        problems.append(f"--gpus {inp.gpus} must be a positive multiple of --tp {inp.tp}")
    for flag, v in (("--mem-fraction", inp.mem_fraction), ("--hit-rate", inp.hit_rate)):
        if not 0 < v <= 1:
            problems.append(f"{flag} {v}: must be in (0, 1]")
    rates: tuple[tuple[str, float | None], ...] = (
        ("--read-gbps", inp.read_gbps), ("--l2-gbps", inp.l2_gbps), ("--turn-s", inp.turn_s),
        ("--ttft", inp.ttft_s), ("--prefill-tps", inp.prefill_tps),
        ("--hicache-ratio", inp.l2_ratio))
    for flag, rate in rates:
        if rate is not None and not rate > 0:
            problems.append(f"{flag} {rate}: must be more than 0")
    if not 0 <= inp.think_s < math.inf:
        problems.append(f"--think-s {inp.think_s}: must be a finite number of seconds, 0 or "
                        "more (0: users return at once)")
    if inp.target_users is not None and inp.target_users < 1:
        problems.append(f"--users {inp.target_users}: must be at least 1 (the users the tier is "
                        "sized for)")
    if inp.arch.max_context and inp.context > inp.arch.max_context:
        problems.append(f"--context {inp.context}: past {inp.arch.name}'s {inp.arch.max_context:,}"
                        "-token context window (max_position_embeddings); SGLang refuses it")
    if inp.prefix_tokens is not None and inp.prefix_tokens > inp.context:
        problems.append(f"--prefix-tokens {inp.prefix_tokens}: longer than a user's context "
                        f"(--context {inp.context}); a cached prefix is part of that context")
    for flag, size in (("--gpu-mem", inp.gpu_mem), ("--tier-capacity", inp.tier_capacity),
                       ("--hicache-size", inp.l2_size), ("--host-mem", inp.host_mem)):
        if size is not None and size <= 0:
            problems.append(f"{flag} {size}: must be more than 0 bytes")
    if inp.page_size is not None and inp.page_size < 1:
        problems.append(f"--page-size {inp.page_size}: must be at least 1 token")
    if problems:
        raise ConfigError(problems)


def _floor(x: float) -> int:
    return math.floor(x + 1e-9)          # 12 / 0.8 is 15, not 14.999999999999998


def _fits(inp: PlanInputs, static: int, tp: int) -> bool:
    """The weights and one full context fit on each GPU of a TP-`tp` replica."""
    try:
        per_rank = kv_bytes_per_token(inp.arch, DTYPE_BYTES[inp.kv_dtype], tp) * inp.context
    except ConfigError:
        return False
    return static - inp.arch.params * DTYPE_BYTES[inp.weight_dtype] / tp >= per_rank


def min_tp(inp: PlanInputs, static: int) -> int | None:
    """The least TP (dividing the heads as SGLang needs) whose GPUs hold the weights and one full
    context, or None up to the attention heads."""
    return next((tp for tp in range(1, inp.arch.attention_heads + 1)
                 if inp.arch.attention_heads % tp == 0 and _fits(inp, static, tp)), None)


def _tiers(inp: PlanInputs, budget: int, slots: int, per_rank: int, tier_user: int,
           l2_bytes: int) -> tuple[int, list[Carried]]:
    """(contexts the L2 holds beyond HBM's copies, [carried with the L2, with the L3 behind])."""
    replicas = inp.gpus // inp.tp
    # Write-through keeps a host copy of what HBM holds: the L2's own room is what is left.
    l2_free = _floor(max(0, l2_bytes - max(budget, 0)) / per_rank)
    l2_reload = per_rank / (inp.l2_gbps * 1e9)
    l2 = carried(slots, TierSpec("L2", l2_reload, slots + l2_free),
                 inp.think_s, inp.turn_s, inp.ttft_s)
    room = None if inp.tier_capacity is None else inp.tier_capacity // tier_user // replicas
    # every rank reads its share (MLA: the same latent copy each) to host memory, then to HBM
    l3_reload = per_rank * inp.tp / (inp.read_gbps * 1e9) + l2_reload
    spec = TierSpec(inp.tier_name, l3_reload, room)
    l3 = carried(slots, spec, inp.think_s, inp.turn_s, inp.ttft_s)
    if l2_free < 1 and l3.carried > slots:       # an L3 hit is trimmed to the L2 room
        l3 = Carried(spec.name, l3_reload, l3.ttft_s, l3.by_slots, l3.by_bandwidth, room, slots,
                     "the L2 pool has no room for one context: an L3 hit is trimmed to it")
    return l2_free, [l2, l3]


def make_plan(inp: PlanInputs) -> Plan:
    """Every figure `plan` prints, from the inputs. Raises ConfigError on inconsistent inputs."""
    _check(inp)
    arch, tp = inp.arch, inp.tp
    replicas = inp.gpus // tp
    gpu_mem = inp.gpu_mem if inp.gpu_mem is not None else inp.gpu.memory_bytes
    static = int(gpu_mem * inp.mem_fraction)
    weights = int(arch.params * DTYPE_BYTES[inp.weight_dtype] / tp)
    budget = static - weights
    if inp.l2_size is not None:
        l2_bytes, l2_source = inp.l2_size, f"hicache-size {inp.l2_size / HICACHE_GB:g} GB per GPU"
    else:
        ratio = inp.l2_ratio or DEFAULT_L2_RATIO
        l2_bytes = int(max(budget, 0) * ratio)
        l2_source = (f"hicache-ratio {ratio:g} x the HBM KV pool" if inp.l2_ratio else
                     f"SGLang's default hicache-ratio {ratio:g} x the HBM KV pool (less when host "
                     "memory is short)")
    rows: list[Users] = []
    for dtype in dict.fromkeys((inp.kv_dtype, "fp8")):
        per_rank = kv_bytes_per_token(arch, DTYPE_BYTES[dtype], tp) * inp.context
        tier_user = per_rank * (1 if arch.mla else tp)
        resident = _floor(budget / per_rank) if budget > 0 else 0
        l2_free, conv = _tiers(inp, budget, resident, per_rank, tier_user, l2_bytes)
        best = max(c.carried for c in conv)
        rows.append(Users(dtype, kv_bytes_per_token(arch, DTYPE_BYTES[dtype]) * inp.context,
                          per_rank, resident, resident * replicas, l2_free, conv,
                          best * replicas, tier_user))
    chosen = rows[0]
    target = chosen.with_offload if inp.target_users is None else inp.target_users
    tier_needed = math.ceil(target * inp.hit_rate) * chosen.tier_bytes_per_user
    prefix = inp.prefix_tokens or inp.context
    bpt_rank = kv_bytes_per_token(arch, DTYPE_BYTES[inp.kv_dtype], tp)
    if inp.prefill_tps is not None:
        tps, tps_source = inp.prefill_tps, "given (--prefill-tps)"
    else:
        tps = inp.gpu.bf16_tflops * 1e12 * DEFAULT_MFU / prefill_flops_per_token(arch, prefix)
        tps_source = (f"{DEFAULT_MFU:.0%} of {inp.gpu.bf16_tflops:g} TFLOPS dense BF16 "
                      f"({inp.gpu.name}) / {prefill_flops_per_token(arch, prefix) / 1e9:.0f} GFLOP "
                      f"per token (2 x {arch.active_params / 1e9:.1f}B active params + attention "
                      f"over {prefix} tokens)")
    load_s, prefill_s = prefix_times(prefix, bpt_rank * tp, inp.read_gbps, tps * tp)
    ctx = chosen.kv_bytes_per_user_per_rank
    for_hit = max(budget, 0) + ctx
    l2 = chosen.conversations[0]        # what the L2 would carry were its room no limit
    to_carry = max(budget, 0) + ctx * max(0, min(l2.by_slots, l2.by_bandwidth)
                                          - chosen.resident_per_replica)
    fit_tp = min_tp(inp, static)
    problems = _problems(inp, budget, weights, static, chosen, fit_tp, l2_bytes)
    inputs = {k: v for k, v in asdict(inp).items() if k not in ("arch", "gpu")}
    inputs.update(model=arch.name, gpu=inp.gpu.name)
    return Plan(
        inputs=inputs, kv_bytes_per_token=kv_bytes_per_token(arch, DTYPE_BYTES[inp.kv_dtype]),
        kv_bytes_per_token_per_rank=bpt_rank, kv_heads_per_rank=kv_heads_per_rank(arch, tp),
        replicas=replicas, gpu_mem=gpu_mem, static_bytes_per_gpu=static,
        weight_bytes_per_gpu=weights, kv_budget_per_gpu=budget,
        block_bytes_per_gpu=None if inp.page_size is None else bpt_rank * inp.page_size,
        l2_bytes_per_gpu=l2_bytes, l2_source=l2_source, l2_for_l3_hit_bytes_per_gpu=for_hit,
        l2_to_carry_bytes_per_gpu=to_carry, pinned_host_bytes=l2_bytes * inp.gpus,
        users=rows, target_users=target, tier_bytes_needed=tier_needed,
        tier_users_capacity=(None if inp.tier_capacity is None
                             else inp.tier_capacity // chosen.tier_bytes_per_user),
        prefix_tokens=prefix, prefix_load_bytes=bpt_rank * tp * prefix, prefill_tps_per_gpu=tps,
        prefill_tps_source=tps_source, prefix_load_s=load_s, prefix_prefill_s=prefill_s,
        worth_loading=load_s < prefill_s, min_tp=fit_tp, problems=problems,
        warnings=_warnings(inp, chosen, budget, l2_bytes, for_hit),
        assumptions=_assumptions(inp, arch))


def _problems(inp: PlanInputs, budget: int, weights: int, static: int, chosen: Users,
              fit_tp: int | None, l2_bytes: int) -> list[str]:
    """Why the deployment cannot run (SGLang would refuse to start or serve no full context)."""
    out = []
    fix = (f"the least TP that holds them and one {inp.context}-token context is {fit_tp}"
           if fit_tp else f"no TP up to {inp.arch.attention_heads} holds them and one "
           f"{inp.context}-token context")
    if budget <= 0:
        out.append(f"the weights do not fit: {weights / GiB:.2f} GiB per GPU at TP {inp.tp}, "
                   f"more than the {static / GiB:.2f} GiB for weights + KV (mem fraction "
                   f"{inp.mem_fraction:g}); {fix}")
    elif chosen.resident_per_replica < 1:
        out.append(f"not one {inp.context}-token context fits: it takes "
                   f"{chosen.kv_bytes_per_user_per_rank / GiB:.2f} GiB per GPU "
                   f"({inp.kv_dtype} KV), {budget / GiB:.2f} GiB is left after the weights; "
                   f"{fix}, or use a shorter --context or FP8 KV")
    room = None if inp.host_mem is None else max(inp.host_mem - inp.host_reserve, 0)
    if room is not None and l2_bytes * inp.gpus > room:
        reserve = (f" less SGLang's {inp.host_reserve / GiB:g} GiB reserve" if inp.host_reserve
                   else "")
        out.append(f"the L2 pools do not fit in host memory: {inp.gpus} GPUs x "
                   f"{l2_bytes / HICACHE_GB:.1f} GB = {l2_bytes * inp.gpus / HICACHE_GB:.1f} GB "
                   f"pinned, more than the {room / HICACHE_GB:.1f} GB of {inp.host_mem_source}"
                   f"{reserve}; lower hicache-size to at most "
                   f"{math.floor(room / inp.gpus / HICACHE_GB)} (SGLang refuses to start)")
    return out


def _warnings(inp: PlanInputs, chosen: Users, budget: int, l2_bytes: int,
              for_hit: int) -> list[str]:
    out = []
    if budget > 0 and chosen.resident_per_replica and l2_bytes < for_hit:
        out.append(f"the L2 pool ({l2_bytes / HICACHE_GB:.1f} GB per GPU) has no room beyond "
                   "its copy of the HBM pool for one whole context: an L3 hit is trimmed to the "
                   f"room and the rest recomputed; hicache-size {math.ceil(for_hit / HICACHE_GB)}"
                   " or more takes one")
    return out


def _assumptions(inp: PlanInputs, arch: Architecture) -> list[str]:
    kv = (f"MLA latent (kv_lora_rank {arch.kv_lora_rank} + qk_rope_head_dim "
          f"{arch.qk_rope_head_dim}) x {arch.layers} layers x bytes ({inp.kv_dtype}), one copy, "
          "held whole by every TP rank" if arch.mla else
          f"2 (K and V) x {arch.layers} layers x {arch.kv_heads} KV heads x {arch.head_dim} head "
          f"dim x bytes ({inp.kv_dtype}); KV heads split across TP ranks, replicated when tp > KV "
          "heads")
    mla_read = " (MLA: each rank reads the same latent copy)" if arch.mla else ""
    return [
        f"KV per token = {kv}",
        f"HBM for weights + KV = GPU memory x mem fraction {inp.mem_fraction:g} (SGLang "
        "--mem-fraction-static; the rest is activations and CUDA graphs)",
        f"weights per GPU = parameter count x {DTYPE_BYTES[inp.weight_dtype]:g} B "
        f"({inp.weight_dtype}) / TP {inp.tp}",
        f"a user holds a full {inp.context}-token context; users are counted per replica "
        f"(TP group of {inp.tp} GPU(s)) and summed over {inp.gpus // inp.tp} replica(s)",
        f"a conversation: a {inp.turn_s:g} s turn with its KV in HBM (--turn-s), then "
        f"{inp.think_s:g} s of think time with it parked in a tier (--think-s); a returning user "
        f"must have it back in HBM within {inp.ttft_s:g} s (--ttft; the turn's own prefill comes "
        "on top); once there are more conversations than HBM holds, each parks between turns; "
        "reloads queue for the tier's bandwidth (M/D/1)",
        f"the L2 (host memory, write-through) keeps a copy of the HBM pool; what is left holds "
        f"parked contexts, reloaded at {inp.l2_gbps:g} GB/s per GPU (--l2-gbps); an L3 hit is "
        "read into the L2 first, so it needs one whole context of room there",
        f"returning users come from the {inp.tier_name} once the L2 is full (they parked "
        "longest ago: least recently used)",
        "tier holds every carried user's KV (HiCache write-through); NVMe and Redis need the "
        "same bytes (Redis per-key overhead not counted)",
        f"prefix load reads every rank's share{mla_read} at {inp.read_gbps:.3g} GB/s aggregate per "
        "replica" + (f" ({inp.read_source})" if inp.read_source else "") + "; "
        f"prefill scales linearly over the {inp.tp} GPU(s) of a replica",
    ]
