"""The offload gain's model (`offload.plan.reload`): Little's law over the HBM slots, M/D/1 on
the tier's bandwidth within the TTFT target, the tier's room."""

from __future__ import annotations

import pytest

from offload.plan.reload import TierSpec, carried, max_utilisation, queued_ttft


def test_slots_carry_turn_plus_think_over_turn() -> None:
    # 4 slots, 20 s turns, 60 s think, a 0.0 s reload: each slot serves 4 conversations
    c = carried(4, TierSpec("L2", 1e-9, None), think_s=60, turn_s=20, ttft_s=2)
    assert (c.by_slots, c.carried, c.limit) == (16, 16, "HBM slots")
    # the reload holds the slot too: 1 s of it makes 4 x 81 / 21 = 15.4 -> 15
    assert carried(4, TierSpec("L2", 1.0, None), 60, 20, 2).carried == 15


def test_the_ttft_target_caps_the_tiers_utilisation() -> None:
    # k = target / reload = 2: rho <= 2 (2 - 1) / (2 x 2 - 1) = 2/3, and then the mean wait is
    # rho / (2 (1 - rho)) = 1 reload: TTFT = 2 reloads = the target
    assert max_utilisation(1.0, 2.0) == pytest.approx(2 / 3)
    assert queued_ttft(1.0, 2 / 3) == pytest.approx(2.0)
    assert max_utilisation(2.5, 2.0) == 0.0
    # many slots behind a slow tier: bandwidth, not slots, sets the figure (10 slots would carry
    # 37; 1.5 s reloads within 2 s allow rho 0.4, 0.4 x 81.5 / 1.5 = 21 conversations)
    c = carried(10, TierSpec("L3", 1.5, None), 60, 20, 2)
    assert c.limit.endswith("bandwidth within the TTFT target")
    assert c.carried == c.by_bandwidth == 21 < c.by_slots and c.ttft_s <= 2.0 + 1e-9
    # fewer than the slots: those stay in HBM, no reloads
    assert carried(100, TierSpec("L3", 1.5, None), 60, 20, 2).carried == 100


def test_room_caps_and_hbm_is_always_carried() -> None:
    assert carried(4, TierSpec("L2", 0.1, 6), 60, 20, 2).carried == 6
    assert carried(4, TierSpec("L3", 0.1, 2), 60, 20, 2).carried == 4     # fewer than HBM's
    slow = carried(4, TierSpec("L3", 3.0, None), 60, 20, 2)
    assert slow.carried == 4 and slow.limit == "L3 reload 3.00 s is past the TTFT target 2 s"
    assert carried(0, TierSpec("L2", 0.1, None), 60, 20, 2).carried == 0


def test_more_think_time_carries_more_no_think_time_none() -> None:
    spec = TierSpec("L2", 0.5, None)
    figures = [carried(4, spec, think, 20, 2).carried for think in (0, 30, 60, 120, 600)]
    assert figures[0] == 4 and figures == sorted(figures) and figures[-1] > 4 * 10
