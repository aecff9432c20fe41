"""How long SGLang waits for an L3 prefetch before the request goes on: launch's deadline.

SGLang 0.5.23 (`srt/mem_cache/unified_radix_cache.py`, `_start_storage_prefetch_wait`), with
`--hicache-storage-prefetch-policy timeout`, lets a request wait for its prefetch
`prefetch_timeout_base + pages x page_size / 1024 x prefetch_timeout_per_ki_token` seconds from
the first admission poll it is blocked at, then takes what has landed and computes the rest (a
hit query still unanswered is a miss). Its defaults (1 s + 0.25 s per 1K tokens) have no cap:
33 s for a 128K-token prompt; `wait_complete` waits for ever on a stalled tier. SGLang's formula
is linear and has no cap term, so launch caps it through the slope: no prompt is longer than the
context length (SGLang refuses it).

Primitives:
- `Recompute(tokens_per_s, speed_source, context, context_source)`: what launch knows of the
  prefill speed (the worth-it rule's: configured, else the plan estimate for a known model and
  GPU; unknown on CPU, where the backend measures it once serving) and of the longest prompt.
- `recompute_facts(worth_it, values, gpu_name) -> Recompute`: those facts for a deployment.
- `wait_line(recompute, cap_s) -> WaitLine`: base 0 and a per-Ki-token wait of
  min(recomputing 1K tokens, cap / context): a prefetch never waits longer than recomputing its
  tokens would take, nor longer than the cap; unknown speed: the cap line alone.
- `sglang_wait_s(tokens, page_size, base, per_ki)`: SGLang's own deadline for a prefetch.
- `decide(values, set_by_user, user_extra, recompute, cap_s) -> PrefetchChoice`: the flag and
  extra-config keys launch adds (none the user set) and one reason line; a pure function.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from offload.config import WorthItConfig
from offload.errors import ConfigError

POLICY = "hicache_storage_prefetch_policy"
BASE_KEY, PER_KI_KEY = "prefetch_timeout_base", "prefetch_timeout_per_ki_token"
SGLANG_BASE_S, SGLANG_PER_KI_S = 1.0, 0.25     # SGLang's defaults for the two keys
ASSUMED_CONTEXT = 131072     # when neither context-length nor the model's config says


@dataclass(frozen=True)
class Recompute:
    tokens_per_s: float | None          # prefill tokens/s of one replica; None: unknown here
    speed_source: str                   # how it was found, or why it is unknown
    context: int                        # the longest prompt SGLang will take
    context_source: str


@dataclass(frozen=True)
class WaitLine:
    base_s: float
    per_ki_token_s: float
    longest_s: float                    # the wait of a prompt of the whole context
    bound_by: str                       # "recompute" or "cap": which term set the slope


@dataclass(frozen=True)
class PrefetchChoice:
    argv: list[str] = field(default_factory=list)              # the policy flag, if launch adds it
    extra: dict[str, float] = field(default_factory=dict)      # extra-config keys launch adds
    reason: str = ""


def sglang_wait_s(tokens: int, page_size: int, base_s: float, per_ki_token_s: float) -> float:
    """SGLang's deadline for a prefetch of `tokens` (0.5.23: whole pages, `storage_attachment`
    `prefetch_timeout_per_page = page_size / 1024 x per_ki`)."""
    return base_s + (tokens // page_size) * (page_size / 1024 * per_ki_token_s)


def wait_line(rec: Recompute, cap_s: float) -> WaitLine:
    """The deadline launch gives SGLang: base 0 s, per 1K tokens the least of recomputing them
    and the cap spread over the context length."""
    cap_per_ki = cap_s * 1024 / rec.context
    if rec.tokens_per_s is not None and 1024 / rec.tokens_per_s <= cap_per_ki:
        per_ki, by = 1024 / rec.tokens_per_s, "recompute"
    else:
        per_ki, by = cap_per_ki, "cap"
    return WaitLine(0.0, per_ki, rec.context / 1024 * per_ki, by)


def _context(values: argparse.Namespace) -> tuple[int, str]:
    ctx = getattr(values, "context_length", None)
    if isinstance(ctx, int) and ctx > 0:
        return ctx, "context-length"
    from offload.launch.sglang_args import _architecture

    arch, where = _architecture(getattr(values, "model_path", None))
    if arch is not None and arch.max_context > 0:
        return arch.max_context, f"the model's max_position_embeddings ({where})"
    return ASSUMED_CONTEXT, (f"assumed, no context-length and no model config: {where}; a "
                             "longer prompt would wait past the cap")


def recompute_facts(worth_it: WorthItConfig, values: argparse.Namespace,
                    gpu_name: str | None) -> Recompute:
    """The prefill speed the worth-it rule starts from (configured, else the plan estimate for
    the model on `gpu_name`), and the context length."""
    context, context_source = _context(values)
    if worth_it.prefill_tokens_per_s is not None:
        return Recompute(worth_it.prefill_tokens_per_s, "configured: offload.worth_it."
                         "prefill_tokens_per_s", context, context_source)
    if getattr(values, "device", None) == "cpu":
        return Recompute(None, "no preset on device cpu; the backend measures it once serving, "
                         "SGLang's deadline is fixed at start", context, context_source)
    from offload.hicache.worth_it import estimate_prefill_tps

    tps, source = estimate_prefill_tps(str(getattr(values, "model_path", "") or ""), gpu_name,
                                       int(getattr(values, "tp_size", 1) or 1))
    return Recompute(tps, source, context, context_source)


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def decide(values: argparse.Namespace, set_by_user: set[str], user_extra: Mapping[str, Any],
           rec: Recompute, cap_s: float) -> PrefetchChoice:
    """What launch adds for the prefetch wait (nothing the user set) and why. Raises
    ConfigError for a key of the user's extra config that is not a number (SGLang's too)."""
    bad = [f"sglang.hicache-storage-backend-extra-config.{k}: {user_extra[k]!r} is not a number "
           "of seconds" for k in (BASE_KEY, PER_KI_KEY) if k in user_extra
           and (isinstance(user_extra[k], bool) or not isinstance(user_extra[k], (int, float)))]
    if bad:
        raise ConfigError(bad)
    line = wait_line(rec, cap_s)
    policy = getattr(values, POLICY, "timeout")
    if rec.tokens_per_s is None:
        slope = f"prefill speed unknown ({rec.speed_source}): the cap alone sets the slope"
    else:
        slope = f"prefill {rec.tokens_per_s:,.0f} tokens/s ({rec.speed_source})"
        if line.bound_by == "cap":
            slope += ": the cap sets the slope, shorter prompts wait less than recomputing takes"
    why = (f"a prefetch waits no longer than recomputing its tokens would take, nor past "
           f"{cap_s:g} s (offload.worth_it.max_prefetch_wait_s) at the {rec.context:,}-token "
           f"context ({rec.context_source}); {slope}; past its deadline the request goes on with "
           "what has loaded and computes the rest, so a stalled tier costs at most that")
    flag = "--" + POLICY.replace("_", "-")
    if POLICY in set_by_user and policy != "timeout":
        unbounded = ("waits for ever on a stalled tier" if policy == "wait_complete" else
                     "never waits: a hit still loading is computed")
        return PrefetchChoice(reason=(
            f"{flag} {policy}: set in the config, it {unbounded} (launch would pick timeout with "
            f"{BASE_KEY} 0 and {PER_KI_KEY} {_fmt(line.per_ki_token_s)}: {why})"))
    argv = [] if policy == "timeout" else [flag, "timeout"]
    # rounded down: the printed figure never waits past the line
    picked = {BASE_KEY: line.base_s, PER_KI_KEY: math.floor(line.per_ki_token_s * 1e6) / 1e6}
    extra = {k: v for k, v in picked.items() if k not in user_extra}
    base = float(user_extra.get(BASE_KEY, line.base_s))
    per_ki = float(user_extra.get(PER_KI_KEY, line.per_ki_token_s))
    where = "set in the config" if POLICY in set_by_user else "SGLang's default"
    head = f"{flag} timeout ({where}), {BASE_KEY} {_fmt(base)} s, {PER_KI_KEY} {_fmt(per_ki)} s"
    if not extra:
        longest = base + rec.context / 1024 * per_ki
        return PrefetchChoice(argv, {}, (
            f"{head}: set in the extra config; a {rec.context:,}-token prompt waits up to "
            f"{longest:,.1f} s (launch would pick {BASE_KEY} 0, {PER_KI_KEY} "
            f"{_fmt(line.per_ki_token_s)}: {why})"))
    return PrefetchChoice(argv, extra, f"{head}: {why}")


__all__ = ["ASSUMED_CONTEXT", "PrefetchChoice", "Recompute", "WaitLine", "decide",
           "recompute_facts", "sglang_wait_s", "wait_line"]
