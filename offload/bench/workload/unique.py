"""The unique-prompt run of `bench workload --unique`: what the tier costs where nothing repeats.

Every request is a prompt of its own: SGLang's client (`offload.bench.workload.client`) with
its generated-shared-prefix dataset cut to one prompt per group and one turn, sent as token ids
(`--tokenize-prompt`, native `/generate`: no chat template puts the same tokens in front of
every prompt), as many requests as the standard run (groups x users x turns), each of
`--prefix-tokens + --question-tokens` tokens (the standard run's first turn), `--output-tokens`
generated, `--concurrency` in flight. No prefix ever repeats, so an L3 can only cost: it writes
every page back and serves nothing.

- `prompts(model, w, scratch)`: each request's token ids exactly as the client builds them (its
  generator, seed and tokenizer); `shared_first_pages(prompts, page)`: the pairs of prompts whose
  first page is the same (0: no cache could serve any request a page).
- `unique_runs(args, work, tiers, w, serve)`: per round (`--repeat`, the tiers alternating: A B
  A B) and tier, a fresh server (no restart): its warm-up prompt's write-back, the client's run,
  the write-back of the run (`settle_s`: how long the L3 kept growing after the client ended),
  and what the L3 grew by (`l3`: blocks and bytes by the store's own books, the file backend's
  files); the result's `runs`, `summary` (medians per tier), `ratios` and `first_pages`.
- `ratios(runs, tiers)`: each L3 tier against no L3 of the same round (requests/s, tokens/s,
  mean and p90 TTFT), the median over rounds, and the targets (`TARGETS`: >= 0.97x the
  throughput, <= 1.05x the mean TTFT).
"""

from __future__ import annotations

import contextlib
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from offload.bench.common import Args, median_of
from offload.bench.workload import client as wc
from offload.bench.workload.server import describe

# key -> (bound, value): ours / none of the same round, median over rounds (issue 35 item 5)
TARGETS: dict[str, tuple[str, float]] = {"requests_per_s": ("at_least", 0.97),
                                         "tokens_per_s": ("at_least", 0.97),
                                         "ttft_mean": ("at_most", 1.05)}


def prompts(model: str, w: wc.Workload, scratch: Path) -> list[list[int]]:
    """Each request's token ids, exactly as SGLang's client builds them for the unique `w`."""
    import numpy as np
    from sglang.benchmark.datasets import generated_shared_prefix as gsp
    from sglang.benchmark.utils import get_tokenizer

    tokenizer = get_tokenizer(model)
    random.seed(w.seed)                    # what the client seeds before it builds the dataset
    np.random.seed(w.seed)
    cache = scratch / f"gsp-unique-{w.seed}.pkl"   # its prompt cache, private (never a stale one)
    cache.unlink(missing_ok=True)
    keep = gsp.get_gen_prefix_cache_path
    gsp.get_gen_prefix_cache_path = lambda *a, **k: cache
    try:
        with contextlib.redirect_stdout(sys.stderr):   # its chatter, not our table
            rows = gsp.sample_generated_shared_prefix_requests(
                num_groups=w.requests, prompts_per_group=1, system_prompt_len=w.prefix,
                question_len=w.question, output_len=w.output, range_ratio=1.0,
                tokenizer=tokenizer, seed=w.seed, num_turns=1, input_ids=True)
    finally:
        gsp.get_gen_prefix_cache_path = keep
        cache.unlink(missing_ok=True)
    return [[int(t) for t in r.prompt] for r in rows]


def shared_first_pages(prompts: Sequence[Sequence[int]], page: int) -> int:
    """Pairs of prompts whose first `page` tokens are the same (a prompt shorter than a page has
    no page to share)."""
    seen: dict[tuple[int, ...], int] = {}
    for p in prompts:
        if len(p) >= page:
            head = tuple(p[:page])
            seen[head] = seen.get(head, 0) + 1
    return sum(n * (n - 1) // 2 for n in seen.values())


def _first_pages(info: dict[str, Any], w: wc.Workload, scratch: Path) -> dict[str, Any]:
    """The run's own check that no prompt shares a first page with another."""
    model, page = str(info.get("model_path") or ""), int(info.get("page_size") or 1)
    try:
        ps = prompts(model, w, scratch)
    except Exception as e:          # noqa: BLE001 -- a figure of the report, not the run's fate
        return {"page": page, "prompts": None, "shared_pairs": None,
                "why": f"{type(e).__name__}: {e}"}
    return {"page": page, "prompts": len(ps), "shared_pairs": shared_first_pages(ps, page),
            "prompt_tokens": sorted({len(p) for p in ps})}


def _bytes_metric(text: str) -> int | None:
    """Our tier's bytes written, from SGLang's /metrics (`sglang_offload_bytes_total`,
    direction write; None where the tier's metrics are off)."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("sglang_offload_bytes_total{") and 'direction="write"' in line:
            try:
                total += float(line.rpartition("}")[2].strip())
                found = True
            except ValueError:
                continue
    return int(total) if found else None


def _metric(t: Any) -> int | None:
    try:
        return _bytes_metric(t.server.get("/metrics"))
    except (OSError, ValueError):
        return None


def unique_runs(args: Args, work: Path, tiers: list[str], w: wc.Workload,
                serve: Callable[..., Any], info: Callable[[Any], dict[str, Any]]
                ) -> dict[str, Any]:
    """The unique run's rounds; `serve(args, tier, d, name)` starts a ready server, `info(t)`
    is its /get_server_info."""
    runs: list[dict[str, Any]] = []
    out: dict[str, Any] = {}
    for rnd in range(args.repeat):
        for tier in tiers:
            d = work / f"unique-{tier}-{rnd}"
            t = serve(args, tier, d, "server")
            try:
                if "server" not in out:
                    si = info(t)
                    out["server"] = describe(si, "hicache_write_policy")
                    out["first_pages"] = _first_pages(si, w, work)
                # the warm-up prompt's write-back, not counted; every tier waits alike (no L3's
                # settle is its quiet wait), so none's run does not start sooner after its start
                t.settle()
                b0, m0 = t.usage(), _metric(t)
                res = wc.run_client(t.server.url, w, d / "run.jsonl", d, args.client_timeout)
                ended = time.monotonic()
                t.settle()
                settle_s = max(0.0, time.monotonic() - ended - 3.0)   # less settle's quiet
                b1, m1 = t.usage(), _metric(t)
            except Exception:
                print(f"--- {t.server.log} (last lines) ---\n{t.server.tail()}", file=sys.stderr)
                raise
            finally:
                t.server.stop()
            s = wc.summary(res)
            s["throughput"]["tokens_per_s"] = round(s["throughput"]["input_tokens_per_s"]
                                                    + s["throughput"]["output_tokens_per_s"], 1)
            s["l3"] = {"blocks": b1[0] - b0[0], "bytes": b1[1] - b0[1],
                       "bytes_written_metric": (m1 - m0 if m0 is not None and m1 is not None
                                                else None),
                       "settle_s": round(settle_s, 1)}
            runs.append({"tier": tier, "round": rnd, "first_request_s": t.first_request_s, **s})
            print(f"  unique {tier} round {rnd + 1}: TTFT mean {s['ttft_ms']['mean']} ms, "
                  f"{s['throughput']['requests_per_s']} req/s, L3 +{s['l3']['bytes']} bytes",
                  file=sys.stderr)
    out["runs"] = runs
    out["summary"] = {tier: median_of([{k: r[k] for k in ("requests", "failed", "ttft_ms",
                                                          "throughput", "cached_tokens",
                                                          "prompt_tokens", "hit_rate", "l3")}
                                       for r in runs if r["tier"] == tier]) for tier in tiers}
    out["ratios"] = ratios(runs, tiers)
    return out


def _figures(r: dict[str, Any]) -> dict[str, float | None]:
    return {"requests_per_s": r["throughput"]["requests_per_s"],
            "tokens_per_s": r["throughput"]["tokens_per_s"],
            "ttft_mean": r["ttft_ms"]["mean"], "ttft_p90": r["ttft_ms"]["p90"]}


def _div(x: float | None, y: float | None) -> float | None:
    return round(x / y, 3) if x and y else None


def ratios(runs: list[dict[str, Any]], tiers: list[str]) -> dict[str, Any]:
    """`{tier}/none` for each L3 tier: per round (against no L3 of that round), the median over
    rounds, and each target met or not (a missing figure misses)."""
    out: dict[str, Any] = {}
    base = {r["round"]: _figures(r) for r in runs if r["tier"] == "none"}
    for tier in tiers:
        if tier == "none":
            continue
        per = []
        for r in runs:
            if r["tier"] == tier and r["round"] in base:
                f, b = _figures(r), base[r["round"]]
                per.append({k: _div(f[k], b[k]) for k in f})
        med: dict[str, float | None] = {}
        for k in ("requests_per_s", "tokens_per_s", "ttft_mean", "ttft_p90"):
            seen = [x for p in per if (x := p[k]) is not None]
            med[k] = statistics.median(seen) if seen else None
        targets = {}
        for key, (bound, value) in TARGETS.items():
            got = med[key]
            met = got is not None and (got >= value if bound == "at_least" else got <= value)
            targets[key] = {bound: value, "met": met}
        out[f"{tier}/none"] = {"rounds": per, "median": med, "targets": targets}
    return out
