"""Printing a Plan: `format_table(plan, arch)` (what `plan` shows) and `format_comment(plan)` (the
sizing block of a deployment file's header, `plan --comment`; tests keep the shipped configs'
blocks equal to it). Figures only; every one is computed by `offload.plan.model.make_plan`.
"""

from __future__ import annotations

from offload.plan.dtypes import DTYPE_BYTES
from offload.plan.model import HICACHE_GB, GiB, Plan
from offload.plan.presets import Architecture
from offload.plan.reload import Carried


def _gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"


def _size(n: float) -> str:
    return f"{n / GiB:,.2f} GiB" if abs(n) < (1 << 40) else f"{n / (1 << 40):,.2f} TiB"


def _rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _gb(n: float) -> str:
    """SGLang's --hicache-size unit."""
    return f"{n / HICACHE_GB:,.1f} GB"


def _bytes(n: float) -> str:
    """A block or a context, in the unit that reads best (binary units)."""
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= mult:
            return f"{n / mult:.3g} {unit}"
    return f"{n:g} B"


def _ratio(plan: Plan, l2_bytes: int) -> str:
    """The hicache-ratio that gives `l2_bytes` per GPU (the L2 over the HBM KV pool)."""
    if plan.kv_budget_per_gpu <= 0:
        return ""
    return f" = hicache-ratio {l2_bytes / plan.kv_budget_per_gpu:.2f}"


def _cap_note(plan: Plan) -> str:
    """What the tier's capacity does to the 'with offload' column."""
    held, u = plan.tier_users_capacity, plan.users[0]
    if held is None:
        return "the tier's capacity not given (--tier-capacity): not a limit"
    if held < u.resident:
        return (f"the tier holds {held} users, fewer than the {u.resident} in HBM: the L3 adds "
                "none")
    return f"the tier holds {held} users"


def _short_note(plan: Plan) -> str:
    """Said when the tier needed is more than --tier-capacity (HBM users are stored too)."""
    cap = plan.inputs.get("tier_capacity")
    if cap is None or plan.tier_bytes_needed <= cap:
        return ""
    return f"; more than --tier-capacity {_size(cap)}, which holds {plan.tier_users_capacity}"


def _conversation_rows(conv: list[Carried]) -> list[str]:
    lines = [f"    {'tier':<8}{'reload':>9}{'TTFT':>9}{'HBM slots':>11}{'bandwidth':>11}"
             f"{'room':>7}{'carried':>9}  limit"]
    for c in conv:
        room = "-" if c.by_room is None else str(c.by_room)
        lines.append(f"    {c.tier:<8}{c.reload_s:>7.2f} s{c.ttft_s:>7.2f} s{c.by_slots:>11}"
                     f"{c.by_bandwidth:>11}{room:>7}{c.carried:>9}  {c.limit}")
    return lines


def format_table(plan: Plan, arch: Architecture) -> str:
    i = plan.inputs
    tp, rep = i["tp"], plan.replicas
    kv_desc = (f"({arch.kv_lora_rank} + {arch.qk_rope_head_dim}) x {arch.layers} layers x "
               f"{DTYPE_BYTES[i['kv_dtype']]:g} B (MLA latent, one copy, every rank holds it)"
               if arch.mla else f"2 x {arch.layers} layers x {arch.kv_heads} KV heads x "
               f"{arch.head_dim} x {DTYPE_BYTES[i['kv_dtype']]:g} B")
    u = plan.users[0]
    lines = [
        f"plan: {arch.name} on {i['gpus']} x {i['gpu']} (TP {tp}, {rep} replica(s)), "
        f"{i['context']} tokens per user",
        "",
        f"  model            {arch.layers} layers, {arch.kv_heads} KV heads x {arch.head_dim} head "
        f"dim, {arch.params / 1e9:.2f}B params  [{i['model_source']}]",
        f"  KV per token     {plan.kv_bytes_per_token:,} B = {kv_desc}",
        f"    per rank       {plan.kv_bytes_per_token_per_rank:,} B"
        + ("" if arch.mla else f" ({plan.kv_heads_per_rank} KV head(s) per rank)"),
    ]
    if plan.block_bytes_per_gpu is not None:
        lines.append(f"  block            {i['page_size']} tokens (page-size) = "
                     f"{_bytes(plan.block_bytes_per_gpu)} per GPU (K and V, every layer)")
    lines += [
        f"  GPU memory       {_gib(plan.gpu_mem)} x {i['mem_fraction']:g} = "
        f"{_gib(plan.static_bytes_per_gpu)} for weights + KV"
        + (" (--gpu-mem)" if i["gpu_mem"] is not None else ""),
        f"  weights per GPU  {arch.params / 1e9:.2f}B x {DTYPE_BYTES[i['weight_dtype']]:g} B "
        f"({i['weight_dtype']}) / TP {tp} = {_gib(plan.weight_bytes_per_gpu)}",
        f"  KV budget / GPU  {_gib(plan.kv_budget_per_gpu)}"
        + ("   (the weights do not fit)" if plan.kv_budget_per_gpu <= 0 else ""),
        f"  L2 host pool     {_gb(plan.l2_bytes_per_gpu)} per GPU ({plan.l2_source}); "
        f"{_gb(plan.pinned_host_bytes)} pinned for {i['gpus']} GPU(s)",
        f"    sizing         an L3 hit needs {_gb(plan.l2_for_l3_hit_bytes_per_gpu)} per GPU"
        f"{_ratio(plan, plan.l2_for_l3_hit_bytes_per_gpu)} (the copy of the HBM pool + one "
        f"context); every carried conversation in L2: {_gb(plan.l2_to_carry_bytes_per_gpu)}"
        f"{_ratio(plan, plan.l2_to_carry_bytes_per_gpu)}",
        "",
        f"  {'KV dtype':<9}{'KV / user':>12}{'per rank':>12}{'users in HBM':>14}"
        f"{'L2 holds':>10}{'with offload':>14}",
    ]
    for row in plan.users:
        lines.append(f"  {row.kv_dtype:<9}{_gib(row.kv_bytes_per_user):>12}"
                     f"{_gib(row.kv_bytes_per_user_per_rank):>12}{row.resident:>14}"
                     f"{row.l2_contexts_per_replica * rep:>10}{row.with_offload:>14}")
    verdict = "worth loading" if plan.worth_loading else "NOT worth loading (recompute instead)"
    lines += [
        f"  (with offload: conversations carried within a {i['ttft_s']:g} s TTFT, {i['think_s']:g}"
        f" s think time, {i['turn_s']:g} s turns; {_cap_note(plan)})",
        "",
        f"  conversations per replica, {u.kv_dtype} KV:",
        *_conversation_rows(u.conversations),
        "",
        f"  tier needed      {_size(plan.tier_bytes_needed)} of NVMe or Redis for "
        f"{plan.target_users} users at hit rate {i['hit_rate']:g} "
        f"({_gib(u.tier_bytes_per_user)} per user)" + _short_note(plan),
        f"  prefix           {plan.prefix_tokens} tokens = {_gib(plan.prefix_load_bytes)}: load "
        f"{plan.prefix_load_s:.2f} s at {i['read_gbps']:.3g} GB/s"
        + (f" ({i['read_drives']} drives combined)" if i["read_drives"] > 1 else "")
        + " vs prefill "
        f"{plan.prefix_prefill_s:.2f} s -> {verdict}",
        f"  prefill rate     {_rate(plan.prefill_tps_per_gpu)} tokens/s per GPU: "
        f"{plan.prefill_tps_source}",
        "",
    ]
    for title, items in (("cannot run", plan.problems), ("warnings", plan.warnings)):
        if items:
            lines += [f"{title}:", *(f"  - {p}" for p in items), ""]
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in plan.assumptions]
    return "\n".join(lines)


def format_comment(plan: Plan) -> str:
    """The figures a deployment file's header states, as `#   ` comment lines."""
    i = plan.inputs
    u = plan.users[0]
    ctx_k = f"{i['context'] // 1024}K" if i["context"] % 1024 == 0 else str(i["context"])
    lines = [
        f"KV: {_bytes(plan.kv_bytes_per_token_per_rank)} of {i['kv_dtype']} per token per GPU "
        f"({_bytes(plan.kv_bytes_per_token)} for the model); one {ctx_k}-token context: "
        f"{_bytes(u.kv_bytes_per_user_per_rank)} per GPU, {_bytes(u.kv_bytes_per_user)} in all",
    ]
    if plan.block_bytes_per_gpu is not None:
        lines.append(f"block (page-size {i['page_size']}): {_bytes(plan.block_bytes_per_gpu)} per "
                     "GPU (K and V, every layer)")
    lines += [
        f"HBM: {_bytes(plan.weight_bytes_per_gpu)} of weights and {_bytes(plan.kv_budget_per_gpu)}"
        f" of KV per GPU: {u.resident} whole contexts in all",
        f"L2: {_gb(plan.l2_bytes_per_gpu)} per GPU, {_gb(plan.pinned_host_bytes)} pinned: "
        f"{u.l2_contexts_per_replica * plan.replicas} contexts besides its copy of the HBM pool; "
        f"an L3 hit needs {_gb(plan.l2_for_l3_hit_bytes_per_gpu)} per GPU",
    ]
    l3 = u.conversations[-1]
    held = plan.tier_users_capacity
    lines.append(f"{l3.tier}: " + (f"{_size(i['tier_capacity'])} holds {held} contexts; "
                                   if held is not None else "")
                 + f"one loads in {plan.prefix_load_s:.2f} s at {i['read_gbps']:.3g} GB/s")
    lines.append(f"with offload: {u.with_offload} conversations ({u.resident} in HBM at once) "
                 f"within a {i['ttft_s']:g} s TTFT, {i['think_s']:g} s think time, "
                 f"{i['turn_s']:g} s turns")
    lines += [f"cannot run: {p}" for p in plan.problems]
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(f"#   {line}" for line in lines)
