"""The concurrency question of `bench workload --sweep-users LIST --ttft-target-ms MS`.

How many users with long contexts does one box serve within a TTFT target, with and without the
tier? Per tier (one server each, the tiers alternating over `--repeat` rounds) and per user count
U, ascending: U users, each with a context of its own (`--prefix-tokens`: one generated-shared-
prefix group per user, `--turns` turns), all in flight, send their conversation; then, once the
L3 stopped growing (their write-back landed, as in the restart run), the same users come back and
send it again, and that second pass is measured. What L1/L2 could not keep
(`--l1-tokens`, `--l2-ratio`) is loaded from the L3 or recomputed. The sweep of a tier stops at
the first U whose p90 TTFT passes the target; `max_users` is the largest U within it (the
smallest over rounds).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Callable

from offload.bench.common import Args
from offload.bench.workload import client as wc


def sweep(args: Args, work: Path, tiers: list[str], over: dict[str, Any], w: wc.Workload,
          serve: Callable[..., Any]) -> dict[str, Any]:
    counts = [int(x) for x in args.sweep_users.split(",")]
    target = float(args.ttft_target_ms)
    steps: dict[str, list[list[dict[str, Any]]]] = {t: [] for t in tiers}
    for rnd in range(args.repeat):
        for tier in tiers:
            d = work / f"sweep-{tier}-{rnd}"
            t = serve(args, tier, d, over, "server")
            rows: list[dict[str, Any]] = []
            try:
                for users in counts:
                    step = dataclasses.replace(w, groups=users, users=1, concurrency=users,
                                               seed=w.seed + users)
                    wc.run_client(t.server.url, step, d / f"u{users}-first.jsonl", d,
                                  args.client_timeout)
                    if tier != "none":   # the users come back once their KV reached the L3
                        t.settle()
                    s = wc.summary(wc.run_client(t.server.url, step, d / f"u{users}-back.jsonl",
                                                 d, args.client_timeout))
                    p90 = s["ttft_ms"]["p90"]
                    rows.append({"users": users, "ttft_ms": s["ttft_ms"],
                                 "throughput": s["throughput"], "cached_by_tier":
                                 s["cached_by_tier"], "hit_rate": s["hit_rate"],
                                 "failed": s["failed"],
                                 "within": p90 is not None and p90 <= target and not s["failed"]})
                    print(f"  sweep {tier} round {rnd + 1}: {users} users, p90 TTFT {p90} ms",
                          file=sys.stderr)
                    if not rows[-1]["within"]:
                        break
            finally:
                t.server.stop()
            steps[tier].append(rows)
    best = {tier: min(max((r["users"] for r in rows if r["within"]), default=0)
                      for rows in rounds) for tier, rounds in steps.items()}
    return {"ttft_target_ms": target, "users": counts, "steps": steps, "max_users": best}
