"""`sglang-offload bench workload`: many users, long shared prefixes, multi-turn, on SGLang's client.

The workload is SGLang's own: `python -m sglang.benchmark.serving --dataset-name
generated-shared-prefix --gsp-num-turns T --cache-report` (`offload.bench.workload_client`):
`--groups` shared prefixes of `--prefix-tokens`, `--users` conversations on each, `--turns`
turns of `--question-tokens` new tokens and `--output-tokens` greedy tokens, `--concurrency`
users in flight. It runs against one server per tier (`--tiers`, `offload.bench.workload_tiers`):
no L3, SGLang's stock `file` L3, ours; the same deployment file, so the same engine flags, with
L1 (`--l1-tokens`, SGLang's max-total-tokens) and L2 (`--l2-ratio`, its hicache-ratio) set over
the file's (keep them below the working set so that L3, or a recompute, serves what they drop).

Restart run (the default): each tier's server serves the workload, waits for its write-back,
restarts on the same L3 (L1/L2 empty), and serves the same workload again (the same users coming
back: every conversation re-sent, turn by turn). Per tier and phase (before / after the
restart): TTFT mean / p50 / p90, throughput, cached tokens by tier (device / host / storage from
SGLang's cached_tokens_details), and the storage hits SGLang did not load (by its own metrics,
on for every tier: `host_capacity` is a hit trimmed to the L2 host pool's room, the rest
recomputed; it falls on whichever users' prefetches overlap, so it moves the mean TTFT of any L3
from run to run); ratios of ours to no L3 and to `file` (targets: <= 0.5x and <=
0.8x, after the restart); greedy-output agreement with the reference (the first tier's first
phase), where a differing turn's top-2 logprob margin (`offload.bench.workload_margin`) tells a
near-tie of a random-weight model (margin below `--tie-margin`) from a real difference (exit 1).
`--repeat` rounds alternate the tiers (A B C A B C); medians are reported, every round in --json.

Unique (`--unique`, `offload.bench.workload_unique`): no prefix ever repeats; as many requests
as the standard run, each a prompt of its own; per tier and round one server, no restart; each
L3 against no L3 of the same round: requests/s, tokens/s, mean and p90 TTFT (targets >= 0.97x
the throughput, <= 1.05x the mean TTFT), and the bytes the L3 wrote. Exit 1 on a failed request
or where two prompts shared a first page.

Sweep (`--sweep-users LIST --ttft-target-ms MS`): how many users with long contexts the box
serves within a TTFT target, per tier. For each user count U (ascending) on one server per tier:
U users, each with a context of its own (`--prefix-tokens`), all in flight, send their
conversation; then they come back and send it again (measured); the sweep stops at the first U
whose p90 TTFT exceeds the target. Reported: each step, and the most users within the target.
"""

from __future__ import annotations

import json
import random
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from offload.argtypes import count, names, positive, work_dir
from offload.bench import workload_client as wc
from offload.bench.common import JSON, Args, Option, Outcome, drop_tree_cache, median_of, scratch
from offload.bench.serve import deployment
from offload.bench.workload_tiers import TIERS, StartedTier, not_loaded, start
from offload.errors import RunError, UsageError
from offload.launch.server import free_port

TARGETS = {"ours/none": 0.5, "ours/file": 0.8}     # TTFT after the restart, issue 25
WARM, WARM_SEED = 512, 7                 # tokens and seed of each server's warm-up prompt
HOST_MEMORY = "Not enough host memory available"      # SGLang's refusal to size its L2 pool
START_TRIES, START_WAIT_S = 5, 30


def _ratio(text: str) -> float:
    value = positive(text)
    if value <= 1:
        raise ValueError("must be more than 1 (SGLang's host pool holds the device pool and more)")
    return value


def _users(text: str) -> str:
    values = [count(x.strip()) for x in text.split(",")]
    if values != sorted(set(values)):
        raise ValueError("user counts must be ascending, each once (e.g. 1,2,4,8)")
    return text


OPTIONS = (
    Option(("--config",), "deployment YAML every tier's server starts from (sglang-offload "
           "launch); its engine flags are used unchanged but for --l1-tokens / --l2-ratio "
           "(and SGLang's enable-metrics, on for every tier)",
           metavar="FILE", required=True),
    Option(("--tiers",), "L3 set-ups to compare, in this order (none: L1/L2 only; file: "
           "SGLang's stock file backend; ours: the offload tier); the first is the reference of "
           "the output agreement", "none,file,ours", names(*TIERS)),
    Option(("--groups",), "shared prefixes (SGLang's --gsp-num-groups)", 4, count),
    Option(("--users",), "conversations per shared prefix (--gsp-prompts-per-group)", 4, count),
    Option(("--turns",), "turns per conversation (--gsp-num-turns)", 3, count),
    Option(("--prefix-tokens",), "tokens of each shared prefix (--gsp-system-prompt-len)", 4096,
           count),
    Option(("--question-tokens",), "new tokens per turn (--gsp-question-len)", 128, count),
    Option(("--output-tokens",), "greedy tokens generated per turn (--gsp-output-len)", 8, count),
    Option(("--concurrency",), "users in flight (SGLang's --max-concurrency)", 4, count),
    Option(("--l1-tokens",), "SGLang's max-total-tokens (the L1 KV pool) over the file's",
           None, count),
    Option(("--l2-ratio",), "SGLang's hicache-ratio (the L2 host pool, times L1) over the "
           "file's", None, _ratio, metavar="X"),
    Option(("--repeat",), "rounds, the tiers alternating in each (medians reported)", 1, count),
    Option(("--cold-restart",), "at the restart, drop every L3 file from the page cache (written "
           "back first), so the restarted server reads its L3 from the disk, as after a reboot or "
           "on another host; without it a backend that reads through the page cache (SGLang's "
           "file L3) finds what it wrote minutes ago in RAM", False, flag=True),
    Option(("--unique",), "the cost where nothing repeats instead of the restart run: as many "
           "requests as the standard run, each a prompt of its own (--prefix-tokens + "
           "--question-tokens token ids, no page shared), one server per tier and round; each "
           "L3 against no L3 of the same round (throughput, mean / p90 TTFT, bytes written)",
           False, flag=True),
    Option(("--sweep-users",), "the concurrency question instead of the restart run: user "
           "counts to try, ascending (each user a context of --prefix-tokens, all in flight)",
           None, _users, metavar="LIST"),
    Option(("--ttft-target-ms",), "with --sweep-users: the p90 TTFT a user count must stay "
           "within (the sweep stops past it)", None, positive, metavar="MS"),
    Option(("--tie-margin",), "top-2 logprob margin (nats) below which a greedy difference is "
           "a near-tie of the model, not a real difference", 0.1, positive, metavar="X"),
    Option(("--seed",), "seed of SGLang's generated prompts; 0: a new one each run", 0, int),
    Option(("--dir",), "where the servers' L3 directories, deployment files and logs go "
           "(default: $TMPDIR; removed at the end)", None, work_dir),
    Option(("--start-timeout",), "seconds a server start may take", 600.0, positive),
    Option(("--client-timeout",), "seconds one run of SGLang's client may take", 3600.0,
           positive),
    JSON,
)


def _pools(args: Args) -> dict[str, Any]:
    """The L1/L2 overrides, and what the file says otherwise (for the working-set note)."""
    try:
        doc = yaml.safe_load(Path(args.config).read_text()) or {}
    except (OSError, ValueError) as e:
        raise UsageError(f"--config {args.config}: cannot read it ({e})") from None
    sg = doc.get("sglang") if isinstance(doc, dict) else None
    if not isinstance(sg, dict):
        raise UsageError(f"--config {args.config}: expected a deployment file with a sglang: "
                         "section")
    # SGLang's Prometheus metrics on every tier alike: what each L3 held but SGLang did not load
    over: dict[str, Any] = {"enable-metrics": True}
    if args.l1_tokens:
        over["max-total-tokens"] = args.l1_tokens
    if args.l2_ratio:
        over["hicache-ratio"] = args.l2_ratio
    return over


def run(args: Args) -> Outcome:
    if args.sweep_users and not args.ttft_target_ms:
        raise UsageError("--sweep-users needs --ttft-target-ms MS (the p90 TTFT to stay within)")
    if args.cold_restart and args.sweep_users:
        raise UsageError("--cold-restart is for the restart run; --sweep-users has no restart")
    if args.ttft_target_ms and not args.sweep_users:
        raise UsageError("--ttft-target-ms is the target of --sweep-users LIST: give both")
    if args.unique and (args.sweep_users or args.cold_restart):
        raise UsageError("--unique is a run of its own: no --sweep-users, no --cold-restart "
                         "(it has no restart)")
    over = _pools(args)
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
    before = signal.signal(signal.SIGTERM, _terminated)
    try:
        with scratch(args.dir, "bench-workload-") as root:
            work = Path(root)
            if args.sweep_users:
                from offload.bench.workload_sweep import sweep

                result["sweep"] = sweep(args, work, tiers, over, w, _serve)
            elif args.unique:
                from offload.bench.workload_unique import unique_runs

                result.update(unique_runs(
                    args, work, tiers, w,
                    lambda a, tier, d, name: _serve(a, tier, d, over, name), server_info))
            else:
                _restart_runs(args, work, tiers, over, w, result)
    finally:
        signal.signal(signal.SIGTERM, before)
    from offload.bench.workload_report import print_result

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


class Terminated(RunError):
    """SIGTERM: unwinds through every `finally` (servers stopped), never retried."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated("bench workload: terminated (SIGTERM); its servers are stopped")


def server_info(t: StartedTier) -> dict[str, Any]:
    """SGLang's /get_server_info ({} where it does not answer)."""
    try:
        info = json.loads(t.server.get("/get_server_info"))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _serve(args: Args, tier: str, d: Path, over: dict[str, Any], name: str) -> StartedTier:
    """Start (and wait for) a tier's server in `d` (its L3 under d/l3, kept across restarts)."""
    d.mkdir(exist_ok=True)
    for attempt in range(START_TRIES):
        port = free_port()
        cfg = deployment(args.config, d / "l3", port, sglang=over, name=f"{name}.yaml")
        t = start(tier, cfg, d / "l3", d / f"{name}.log", f"http://127.0.0.1:{port}")
        try:
            t.server.wait_ready(args.start_timeout)
            break
        except RunError as e:
            # SGLang keeps 10 GiB of host RAM free before it sizes the L2 pool: on a machine
            # others share, a start can find less for a while; wait and try again
            if (isinstance(e, Terminated) or HOST_MEMORY not in t.server.tail(200)
                    or attempt == START_TRIES - 1):
                print(f"--- {t.server.log} (last lines) ---\n{t.server.tail()}",
                      file=sys.stderr)
                t.server.stop()
                raise
            t.server.stop()
            print(f"  {tier}: SGLang found too little free host memory; trying again in "
                  f"{START_WAIT_S} s", file=sys.stderr)
            time.sleep(START_WAIT_S)
    try:
        # one short prompt of its own first: a server's first L3 request pays one-off costs
        # (SGLang loads its hash extension); sent before and after the restart, so after it the
        # L3 read path is warm too. Timed and reported (`first_request_s`), not in the figures.
        warm = [random.Random(WARM_SEED).randrange(10, 250) for _ in range(WARM)]
        t.first_request_s = round(t.server.generate(warm, 1).ttft_s, 3)
    except (RunError, OSError) as e:
        print(f"--- {t.server.log} (last lines) ---\n{t.server.tail()}", file=sys.stderr)
        t.server.stop()
        if isinstance(e, RunError):
            raise
        raise RunError(f"bench workload: the {tier} server at {t.server.url} failed: {e}") from None
    return t


def _not_loaded(t: StartedTier) -> dict[str, int] | None:
    """The server's storage hits SGLang did not load so far (`workload_tiers.not_loaded`); None
    where /metrics does not answer."""
    try:
        return not_loaded(t.server.get("/metrics"))
    except (OSError, ValueError):
        return None


def _client(args: Args, t: StartedTier, w: wc.Workload, out: Path) -> dict[str, Any]:
    try:
        return wc.run_client(t.server.url, w, out, out.parent, args.client_timeout)
    except RunError:
        print(f"--- {t.server.log} (last lines) ---\n{t.server.tail()}", file=sys.stderr)
        raise


def _restart_runs(args: Args, work: Path, tiers: list[str], over: dict[str, Any],
                  w: wc.Workload, result: dict[str, Any]) -> None:
    runs: list[dict[str, Any]] = []
    outputs: dict[tuple[str, int, str], list[str | None]] = {}
    for rnd in range(args.repeat):
        for tier in tiers:
            d = work / f"{tier}-{rnd}"
            row: dict[str, Any] = {"tier": tier, "round": rnd}
            t = _serve(args, tier, d, over, "server-1")
            try:
                if "server" not in result:
                    info = server_info(t)
                    result["server"] = {k: info.get(k) for k in (
                        "model_path", "device", "attention_backend", "page_size",
                        "max_total_num_tokens", "hicache_ratio", "hicache_storage_prefetch_policy")}
                row["first_request_s"] = [t.first_request_s]
                first = _client(args, t, w, d / "before.jsonl")
                unloaded = [_not_loaded(t)]
                row["l3_blocks"] = t.settle() if tier != "none" else 0
            finally:
                t.server.stop()
            if args.cold_restart and tier != "none":
                row["l3_files_dropped"] = drop_tree_cache(str(d / "l3"))
            t = _serve(args, tier, d, over, "server-2")
            try:
                row["first_request_s"].append(t.first_request_s)
                second = _client(args, t, w, d / "after.jsonl")
                unloaded.append(_not_loaded(t))
            finally:
                t.server.stop()
            for phase, res, nl in (("before", first, unloaded[0]), ("after", second, unloaded[1])):
                row[phase] = {**wc.summary(res), "l3_not_loaded_tokens": nl}
                outputs[(tier, rnd, phase)] = wc.texts(res)
            runs.append(row)
            print(f"  {tier} round {rnd + 1}: TTFT p50 {row['before']['ttft_ms']['p50']} ms "
                  f"before the restart, {row['after']['ttft_ms']['p50']} ms after",
                  file=sys.stderr)
    result["runs"] = runs
    result["summary"] = {tier: {p: median_of([r[p] for r in runs if r["tier"] == tier])
                                for p in ("before", "after")} for tier in tiers}
    result["ratios"] = _ratios(result["summary"])
    result["agreement"] = _agreement(args, work, tiers, over, w, outputs)


def _ratios(summary: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a, b in (("ours", "none"), ("ours", "file"), ("file", "none")):
        if a in summary and b in summary:
            for phase in ("before", "after"):
                x, y = summary[a][phase]["ttft_ms"], summary[b][phase]["ttft_ms"]
                out.setdefault(f"{a}/{b}", {})[phase] = {
                    k: round(x[k] / y[k], 3) if x[k] and y[k] else None for k in x}
    for key, target in TARGETS.items():
        if key in out:
            got = out[key]["after"]["mean"]
            out[key]["target"] = {"after_mean_at_most": target,
                                  "met": got is not None and got <= target}
    return out


def _agreement(args: Args, work: Path, tiers: list[str], over: dict[str, Any], w: wc.Workload,
               outputs: dict[tuple[str, int, str], list[str | None]]) -> dict[str, Any]:
    ref_key = (tiers[0], 0, "before")
    ref = outputs[ref_key]
    diffs: list[dict[str, Any]] = []
    for key, other in outputs.items():
        for conv, turn in wc.disagreements(ref, other, w.turns):
            diffs.append({"tier": key[0], "round": key[1], "phase": key[2],
                          "conversation": conv, "turn": turn,
                          "text": other[conv * w.turns + turn]})
    out: dict[str, Any] = {"reference": f"{tiers[0]} before the restart",
                           "requests": len(ref) * len(outputs),
                           "differing_conversations": len(diffs), "near_ties": 0,
                           "real_differences": 0, "differences": diffs}
    if not diffs:
        return out
    from offload.bench import workload_margin as wm

    t = _serve(args, tiers[0], work / "probe", over, "probe")
    try:
        model = str(server_info(t).get("model_path") or "")
        model_id = json.loads(t.server.get("/v1/models"))["data"][0]["id"]
        convs = wm.conversations(model, w, work / "probe")
        for d in diffs:
            c, turn = d["conversation"], d["turn"]
            base = c * w.turns
            msgs = wm.messages(convs[c], ref[base:base + w.turns], turn)
            d.update(wm.probe(t.server.url, model_id, msgs, ref[base + turn] or "",
                              d.pop("text") or "", w.output))
            d["near_tie"] = d["margin"] is not None and d["margin"] < args.tie_margin
    finally:
        t.server.stop()
    out["near_ties"] = sum(1 for d in diffs if d["near_tie"])
    out["real_differences"] = len(diffs) - out["near_ties"]
    out["tie_margin"] = args.tie_margin
    out["margins"] = sorted(d["margin"] for d in diffs if d["margin"] is not None)
    if out["margins"]:
        out["median_margin"] = statistics.median(out["margins"])
    return out
