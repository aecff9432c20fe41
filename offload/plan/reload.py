"""The offload gain, computed: how many conversations a replica carries within a TTFT target.

A conversation alternates a turn (its KV in HBM for `turn_s`, after the reload that brought it
back) and the user's think time (`think_s`, its KV parked in a tier). Primitives:
- `TierSpec`: one tier as one replica sees it: the time to bring one context back into HBM when
  nothing else loads (`reload_s` = bytes / bandwidth), and the contexts it holds (`room`).
- `carried(slots, tier, think_s, turn_s, ttft_s) -> Carried`, the least of three bounds:
  - HBM slots (Little's law): a conversation holds a slot for turn + reload out of every
    turn + reload + think, so `slots` slots carry slots x (turn + reload + think) / (turn + reload);
  - bandwidth within the TTFT target: returning users share the tier's bandwidth; at utilisation
    rho a reload first waits rho / (2 (1 - rho)) reloads (M/D/1), so TTFT = reload x (1 + rho /
    (2 (1 - rho))) <= target caps rho at 2 (k - 1) / (2k - 1), k = target / reload, and the
    conversations at rho x (turn + reload + think) / reload;
  - room: the contexts the tier holds (HBM's own count as carried whatever the tier).
  A tier whose reload alone is past the target carries no more than the slots.
Pure functions; nothing here knows about models or GPUs (`offload.plan.model` builds the tiers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TierSpec:
    name: str                 # "L2 host memory", "L3 (NVMe)"
    reload_s: float           # one context back into HBM, alone
    room: int | None          # contexts the tier holds per replica, HBM's included; None: no cap


@dataclass(frozen=True)
class Carried:
    tier: str
    reload_s: float
    ttft_s: float             # reload + queueing at the load `carried` puts on the tier
    by_slots: int
    by_bandwidth: int
    by_room: int | None
    carried: int              # conversations per replica (at least the HBM slots)
    limit: str                # what sets `carried`


def max_utilisation(reload_s: float, ttft_s: float) -> float:
    """The tier's busy share at which a reload plus its M/D/1 wait takes `ttft_s` (0 when the
    reload alone takes longer)."""
    if reload_s <= 0:
        return 1.0
    k = ttft_s / reload_s
    return 0.0 if k <= 1 else 2 * (k - 1) / (2 * k - 1)


def queued_ttft(reload_s: float, utilisation: float) -> float:
    """A reload plus its mean M/D/1 wait at `utilisation` (< 1)."""
    return reload_s * (1 + utilisation / (2 * (1 - utilisation)))


def _floor(x: float) -> int:
    return math.floor(x + 1e-9)


def carried(slots: int, tier: TierSpec, think_s: float, turn_s: float,
            ttft_s: float) -> Carried:
    """Conversations per replica with `slots` contexts of HBM and `tier` behind them."""
    r = tier.reload_s
    cycle = turn_s + r + think_s
    if slots <= 0:
        return Carried(tier.name, r, r, 0, 0, tier.room, 0, "no context fits in HBM")
    by_slots = _floor(slots * cycle / (turn_s + r))
    rho = max_utilisation(r, ttft_s)
    by_bw = _floor(rho * cycle / r) if r > 0 else by_slots
    bounds = [(by_slots, "HBM slots"), (by_bw, f"{tier.name} bandwidth within the TTFT target")]
    if tier.room is not None:
        bounds.append((tier.room, f"{tier.name} room"))
    if r > ttft_s:
        n, limit = slots, f"{tier.name} reload {r:.2f} s is past the TTFT target {ttft_s:g} s"
    else:
        n, limit = min(bounds)
        if n <= slots:
            n = slots
    util = min(n * r / cycle, 0.999) if n > slots else 0.0    # HBM's own need no reload
    return Carried(tier.name, r, queued_ttft(r, util), by_slots, by_bw, tier.room, n, limit)
