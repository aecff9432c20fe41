"""`run(args)` of `bench workload`: the options checked together, the workload built, one of the
three runs (restart, `--unique`, `--sweep-users`) in a scratch directory (removed at the end, or
kept with `--keep`), the table printed and the exit code (1 on a failed request, a
real output difference, or prompts that shared a page)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

from offload.agree import RANDOM_TOLERANCE, TOLERANCE
from offload.bench.common import Args, Outcome, scratch
from offload.bench.workload import client as wc
from offload.bench.workload.options import pools
from offload.bench.workload.restart import restart_runs
from offload.bench.workload.server import serve, server_info, terminated
from offload.errors import UsageError


def run(args: Args) -> Outcome:
    if args.tie_margin is not None:
        raise UsageError(f"--tie-margin is gone: a differing turn is now asked again with "
                         f"logprobs and judged at the logprob, a near-tie where the reference "
                         f"ranked the other's token within the model's measured tolerance "
                         f"({TOLERANCE} nats; {RANDOM_TOLERANCE} for the random-weight demo: "
                         f"docs/design/agreement.md) of its own; drop the option")
    if args.sweep_users and not args.ttft_target_ms:
        raise UsageError("--sweep-users needs --ttft-target-ms MS (the p90 TTFT to stay within)")
    if args.cold_restart and args.sweep_users:
        raise UsageError("--cold-restart is for the restart run; --sweep-users has no restart")
    if args.ttft_target_ms and not args.sweep_users:
        raise UsageError("--ttft-target-ms is the target of --sweep-users LIST: give both")
    if args.unique and (args.sweep_users or args.cold_restart):
        raise UsageError("--unique is a run of its own: no --sweep-users, no --cold-restart "
                         "(it has no restart)")
    over = pools(args)
    tiers = args.tiers.split(",")
    if len(set(tiers)) != len(tiers):
        raise UsageError(f"--tiers {args.tiers}: each tier once")
    if args.unique and ("none" not in tiers or len(tiers) < 2):
        raise UsageError(f"--unique --tiers {args.tiers}: each L3 is measured against no L3 of "
                         "the same round: give none and at least one L3 (e.g. none,ours)")
    seed = args.seed or int(time.time()) % 1_000_000
    w = wc.Workload(args.groups, args.users, args.turns, args.prefix_tokens,
                    args.question_tokens, args.output_tokens, args.concurrency, seed,
                    bool(args.unique))
    mode = "sweep" if args.sweep_users else "unique" if args.unique else "restart"
    result: dict[str, Any] = {"mode": mode,
                              "workload": {**w.__dict__, "conversations": w.conversations,
                                           "requests": w.requests},
                              "tiers": tiers, "pools": over, "client": wc.CLIENT,
                              "cold_restart": bool(args.cold_restart)}
    # a SIGTERM (a CI timeout, a Ctrl-C'd wrapper) unwinds like an error, so the servers this
    # started are stopped and the scratch directory removed
    before = signal.signal(signal.SIGTERM, terminated)
    try:
        with scratch(args.dir, "bench-workload-", keep=bool(args.keep)) as root:
            work = Path(root)
            if args.keep:
                result["work_dir"] = root
            if args.sweep_users:
                from offload.bench.workload.sweep import sweep

                result["sweep"] = sweep(args, work, tiers, over, w, serve)
            elif args.unique:
                from offload.bench.workload.unique import unique_runs

                result.update(unique_runs(
                    args, work, tiers, w,
                    lambda a, tier, d, name: serve(a, tier, d, over, name), server_info))
            else:
                restart_runs(args, work, tiers, over, w, result)
    finally:
        signal.signal(signal.SIGTERM, before)
    from offload.bench.workload.report import print_result

    print_result(result)
    if args.json:
        print(json.dumps(result, indent=2))
    bad = (result.get("agreement") or {}).get("real_differences", 0)
    if mode == "unique":     # a failed request, or prompts that shared a page: not the run asked
        failed = sum(r["failed"] for r in result["runs"])
        bad = (result.get("first_pages") or {}).get("shared_pairs") or 0
    else:
        failed = sum(r[p]["failed"] for r in result.get("runs", [])
                     for p in ("before", "after"))
    return Outcome(result, 1 if bad or failed else 0)
