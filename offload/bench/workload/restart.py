"""The restart run of `bench workload` (its default): per tier and round, the workload, the
write-back, a restart on the same L3, the same workload again; the medians, the ratios of ours to
no L3 and to `file` against the targets of issue 25, and the greedy outputs' agreement with the
reference (a differing turn probed for its logprob margin, `margin`).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from offload.bench.common import Args, drop_tree_cache, median_of
from offload.bench.workload import client as wc
from offload.bench.workload.server import describe, serve, server_info
from offload.bench.workload.tiers import StartedTier, not_loaded
from offload.errors import RunError

TARGETS = {"ours/none": 0.5, "ours/file": 0.8}     # TTFT after the restart, issue 25


def _not_loaded(t: StartedTier) -> dict[str, int] | None:
    """The server's storage hits SGLang did not load so far (`tiers.not_loaded`); None
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


def restart_runs(args: Args, work: Path, tiers: list[str], over: dict[str, Any],
                  w: wc.Workload, result: dict[str, Any]) -> None:
    runs: list[dict[str, Any]] = []
    outputs: dict[tuple[str, int, str], list[str | None]] = {}
    for rnd in range(args.repeat):
        for tier in tiers:
            d = work / f"{tier}-{rnd}"
            row: dict[str, Any] = {"tier": tier, "round": rnd}
            t = serve(args, tier, d, over, "server-1")
            try:
                if "server" not in result:
                    info = server_info(t)
                    result["server"] = describe(info, "hicache_storage_prefetch_policy")
                row["first_request_s"] = [t.first_request_s]
                first = _client(args, t, w, d / "before.jsonl")
                unloaded = [_not_loaded(t)]
                row["l3_blocks"] = t.settle() if tier != "none" else 0
            finally:
                t.server.stop()
            if args.cold_restart and tier != "none":
                row["l3_files_dropped"] = drop_tree_cache(str(d / "l3"))
            t = serve(args, tier, d, over, "server-2")
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
    from offload.bench.workload import margin as wm

    t = serve(args, tiers[0], work / "probe", over, "probe")
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
