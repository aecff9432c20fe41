"""KV-cache sizing from first principles (the model behind `sglang-offload plan`).

Primitives (pure functions; the model comes from `offload.plan.presets.load_architecture`, a
preset or a HuggingFace config.json):
- `kv_bytes_per_token(arch, kv_bytes, tp)`: 2 x layers x KV heads x head dim x bytes, per rank
  (KV heads split across TP ranks, replicated when tp > KV heads); MLA: (kv_lora_rank +
  qk_rope_head_dim) x layers x bytes, one copy, replicated on every rank.
- `make_plan(inputs) -> Plan`: per-user KV, users that fit in HBM after weights, users served with
  an offload tier (resident slots / active fraction, capped by the tier), tier capacity needed,
  prefix load time vs prefill time.
- `prefix_times` / `worth_loading`: the load-or-recompute rule, reusable by the backend.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from offload.errors import ConfigError
from offload.plan.dtypes import DTYPE_BYTES, canonical
from offload.plan.presets import Architecture, GpuPreset

GiB = 1 << 30
KV_DTYPES = ("bf16", "fp16", "fp8")
WEIGHT_DTYPES = ("bf16", "fp16", "fp8", "int8", "int4")
DEFAULT_MFU = 0.4               # share of dense BF16 peak a long prefill sustains (assumed)
DEFAULT_READ_GBPS = 7.0         # one PCIe Gen4 NVMe drive, sequential read
DEFAULT_ACTIVE_FRACTION = 0.8   # share of users whose KV must be in HBM at the same time
DEFAULT_MEM_FRACTION = 0.9      # SGLang --mem-fraction-static: (weights + KV pool) / HBM
MAX_TOKENS = 1 << 24            # 16M tokens: above any model's context window


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


def parse_tokens(text: str, what: str = "token count") -> int:
    """`131072`, `128K` / `128k` (x1024), `1M` (x2**20). `what` names the option in errors."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise ConfigError([f"{what} '{text}': expected a token count: an integer or e.g. 128K, "
                           "1M"])
    n = float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20}[m.group(2).lower()]
    if n < 1 or n != int(n):
        raise ConfigError([f"{what} '{text}': must be a whole number of at least 1"])
    if n > MAX_TOKENS:
        raise ConfigError([f"{what} '{text}': more than {MAX_TOKENS:,} (16M) tokens, longer "
                           "than any model's context window"])
    return int(n)


def parse_count(text: str, what: str) -> int:
    """`70553706496`, `70.6B`, `8e9`."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kKmMbBtT]?)\s*", str(text))
    if not m:
        raise ConfigError([f"{what} '{text}': expected a count such as 70.6B or 70553706496"])
    mult = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]
    n = int(float(m.group(1)) * mult)
    if n < 1:
        raise ConfigError([f"{what} '{text}': must be at least 1"])
    return n


def parse_dtype(text: str, allowed: tuple[str, ...], flag: str) -> str:
    d = canonical(text)
    if d not in allowed:
        raise ConfigError([f"{flag} '{text}': one of {', '.join(allowed)}"])
    return d


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
    active_fraction: float = DEFAULT_ACTIVE_FRACTION
    tier_capacity: int | None = None     # bytes of NVMe / Redis for the whole deployment
    target_users: int | None = None      # for tier sizing; None = the users served with offload
    hit_rate: float = 1.0
    prefix_tokens: int | None = None     # None = context
    read_gbps: float = DEFAULT_READ_GBPS  # the tier's read bandwidth per replica (all drives)
    prefill_tps: float | None = None     # per GPU; None = derived from the GPU's FLOPS
    model_source: str = ""
    read_drives: int = 1                 # distinct drives behind read_gbps
    read_source: str = ""                # how read_gbps was found ("4 drives x 7 GB/s")


@dataclass(frozen=True)
class Users:
    kv_dtype: str
    kv_bytes_per_user: int               # whole model, all ranks (no replication)
    kv_bytes_per_user_per_rank: int
    resident_per_replica: int            # users whose 128K KV fits in HBM at once
    resident: int                        # all replicas
    with_offload: int                    # resident / active fraction, capped by the tier
    with_offload_uncapped: int
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
    assumptions: list[str]


def _check(inp: PlanInputs) -> None:
    problems = []
    if inp.tp < 1 or inp.gpus < 1 or inp.gpus % inp.tp:
        problems.append(f"--gpus {inp.gpus} must be a positive multiple of --tp {inp.tp}")
    for flag, v in (("--mem-fraction", inp.mem_fraction),
                    ("--active-fraction", inp.active_fraction), ("--hit-rate", inp.hit_rate)):
        if not 0 < v <= 1:
            problems.append(f"{flag} {v}: must be in (0, 1]")
    if inp.read_gbps <= 0 or (inp.prefill_tps is not None and inp.prefill_tps <= 0):
        problems.append("--read-gbps and --prefill-tps must be positive")
    if inp.target_users is not None and inp.target_users < 0:
        problems.append(f"--users {inp.target_users}: cannot be negative")
    if inp.prefix_tokens is not None and inp.prefix_tokens > inp.context:
        problems.append(f"--prefix-tokens {inp.prefix_tokens}: longer than a user's context "
                        f"(--context {inp.context}); a cached prefix is part of that context")
    for flag, size in (("--gpu-mem", inp.gpu_mem), ("--tier-capacity", inp.tier_capacity)):
        if size is not None and size <= 0:
            problems.append(f"{flag} {size}: must be more than 0 bytes")
    if problems:
        raise ConfigError(problems)


def _floor(x: float) -> int:
    return math.floor(x + 1e-9)          # 12 / 0.8 is 15, not 14.999999999999998


def make_plan(inp: PlanInputs) -> Plan:
    """Every figure `plan` prints, from the inputs. Raises ConfigError on inconsistent inputs."""
    _check(inp)
    arch, tp = inp.arch, inp.tp
    replicas = inp.gpus // tp
    gpu_mem = inp.gpu_mem if inp.gpu_mem is not None else inp.gpu.memory_bytes
    static = int(gpu_mem * inp.mem_fraction)
    weights = int(arch.params * DTYPE_BYTES[inp.weight_dtype] / tp)
    budget = static - weights
    cap_bytes = inp.tier_capacity
    rows: list[Users] = []
    for dtype in dict.fromkeys((inp.kv_dtype, "fp8")):
        per_rank = kv_bytes_per_token(arch, DTYPE_BYTES[dtype], tp) * inp.context
        tier_user = per_rank * (1 if arch.mla else tp)
        resident = _floor(budget / per_rank) if budget > 0 else 0
        uncapped = _floor(resident / inp.active_fraction) * replicas
        served = uncapped if cap_bytes is None else min(uncapped, max(resident * replicas,
                                                                      cap_bytes // tier_user))
        rows.append(Users(dtype, kv_bytes_per_token(arch, DTYPE_BYTES[dtype]) * inp.context,
                          per_rank, resident, resident * replicas, served, uncapped, tier_user))
    chosen = rows[0]
    # The users the tier is sized for: those served with offload (capped by --tier-capacity, as
    # the table's column shows), unless --users names a target.
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
    inputs = {k: v for k, v in asdict(inp).items() if k not in ("arch", "gpu")}
    inputs.update(model=arch.name, gpu=inp.gpu.name)
    return Plan(
        inputs=inputs, kv_bytes_per_token=kv_bytes_per_token(arch, DTYPE_BYTES[inp.kv_dtype]),
        kv_bytes_per_token_per_rank=bpt_rank, kv_heads_per_rank=kv_heads_per_rank(arch, tp),
        replicas=replicas, gpu_mem=gpu_mem, static_bytes_per_gpu=static,
        weight_bytes_per_gpu=weights, kv_budget_per_gpu=budget, users=rows, target_users=target,
        tier_bytes_needed=tier_needed,
        tier_users_capacity=None if cap_bytes is None else cap_bytes // chosen.tier_bytes_per_user,
        prefix_tokens=prefix, prefix_load_bytes=bpt_rank * tp * prefix, prefill_tps_per_gpu=tps,
        prefill_tps_source=tps_source, prefix_load_s=load_s, prefix_prefill_s=prefill_s,
        worth_loading=load_s < prefill_s, assumptions=_assumptions(inp, arch))


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
        f"with offload: only {inp.active_fraction:g} of users need their KV in HBM at once; the "
        "others' KV waits on the tier between turns (users = resident / active fraction, capped "
        "by the tier capacity)",
        "tier holds every served user's KV (HiCache write-through); NVMe and Redis need the same "
        "bytes (Redis per-key overhead not counted)",
        f"prefix load reads every rank's share{mla_read} at {inp.read_gbps:.3g} GB/s aggregate per "
        "replica" + (f" ({inp.read_source})" if inp.read_source else "") + "; "
        f"prefill scales linearly over the {inp.tp} GPU(s) of a replica",
    ]


def _gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"


def _size(n: float) -> str:
    return f"{n / GiB:,.2f} GiB" if abs(n) < (1 << 40) else f"{n / (1 << 40):,.2f} TiB"


def _rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _cap_note(plan: Plan) -> str:
    """What --tier-capacity does to the 'with offload' column, in the column's own numbers."""
    held, u = plan.tier_users_capacity, plan.users[0]
    if held is None:
        return "not capped (no --tier-capacity)"
    if u.with_offload >= u.with_offload_uncapped:
        return f"the tier holds {held} users: not a limit"
    if u.with_offload <= u.resident:
        than = "fewer than" if held < u.resident else "no more than"
        return (f"the tier holds {held} users, {than} the {u.resident} in HBM: offload adds "
                f"none (uncapped: {u.with_offload_uncapped})")
    return (f"the tier holds {held} users: caps those served with offload at {u.with_offload} "
            f"(uncapped: {u.with_offload_uncapped})")


def _short_note(plan: Plan) -> str:
    """Said when the tier needed is more than --tier-capacity (HBM users are stored too)."""
    cap = plan.inputs.get("tier_capacity")
    if cap is None or plan.tier_bytes_needed <= cap:
        return ""
    return f"; more than --tier-capacity {_size(cap)}, which holds {plan.tier_users_capacity}"


def format_table(plan: Plan, arch: Architecture) -> str:
    i = plan.inputs
    tp, rep = i["tp"], plan.replicas
    kv_desc = (f"({arch.kv_lora_rank} + {arch.qk_rope_head_dim}) x {arch.layers} layers x "
               f"{DTYPE_BYTES[i['kv_dtype']]:g} B (MLA latent, one copy, every rank holds it)"
               if arch.mla else f"2 x {arch.layers} layers x {arch.kv_heads} KV heads x "
               f"{arch.head_dim} x {DTYPE_BYTES[i['kv_dtype']]:g} B")
    lines = [
        f"plan: {arch.name} on {i['gpus']} x {i['gpu']} (TP {tp}, {rep} replica(s)), "
        f"{i['context']} tokens per user",
        "",
        f"  model            {arch.layers} layers, {arch.kv_heads} KV heads x {arch.head_dim} head "
        f"dim, {arch.params / 1e9:.2f}B params  [{i['model_source']}]",
        f"  KV per token     {plan.kv_bytes_per_token:,} B = {kv_desc}",
        f"    per rank       {plan.kv_bytes_per_token_per_rank:,} B"
        + ("" if arch.mla else f" ({plan.kv_heads_per_rank} KV head(s) per rank)"),
        f"  GPU memory       {_gib(plan.gpu_mem)} x {i['mem_fraction']:g} = "
        f"{_gib(plan.static_bytes_per_gpu)} for weights + KV"
        + (" (--gpu-mem)" if i["gpu_mem"] is not None else ""),
        f"  weights per GPU  {arch.params / 1e9:.2f}B x {DTYPE_BYTES[i['weight_dtype']]:g} B "
        f"({i['weight_dtype']}) / TP {tp} = {_gib(plan.weight_bytes_per_gpu)}",
        f"  KV budget / GPU  {_gib(plan.kv_budget_per_gpu)}"
        + ("   (the weights do not fit)" if plan.kv_budget_per_gpu <= 0 else ""),
        "",
        f"  {'KV dtype':<9}{'KV / user':>12}{'per rank':>12}{'users in HBM':>14}"
        f"{'with offload':>14}",
    ]
    for u in plan.users:
        lines.append(f"  {u.kv_dtype:<9}{_gib(u.kv_bytes_per_user):>12}"
                     f"{_gib(u.kv_bytes_per_user_per_rank):>12}{u.resident:>14}"
                     f"{u.with_offload:>14}")
    cap = _cap_note(plan)
    verdict = "worth loading" if plan.worth_loading else "NOT worth loading (recompute instead)"
    lines += [
        f"  (with offload: active fraction {i['active_fraction']:g}; {cap})",
        "",
        f"  tier needed      {_size(plan.tier_bytes_needed)} of NVMe or Redis for "
        f"{plan.target_users} users at hit rate {i['hit_rate']:g} "
        f"({_gib(plan.users[0].tier_bytes_per_user)} per user)" + _short_note(plan),
        f"  prefix           {plan.prefix_tokens} tokens = {_gib(plan.prefix_load_bytes)}: load "
        f"{plan.prefix_load_s:.2f} s at {i['read_gbps']:.3g} GB/s"
        + (f" ({i['read_drives']} drives combined)" if i["read_drives"] > 1 else "")
        + " vs prefill "
        f"{plan.prefix_prefill_s:.2f} s -> {verdict}",
        f"  prefill rate     {_rate(plan.prefill_tps_per_gpu)} tokens/s per GPU: "
        f"{plan.prefill_tps_source}",
        "",
        "assumptions:",
    ]
    lines += [f"  - {a}" for a in plan.assumptions]
    return "\n".join(lines)
