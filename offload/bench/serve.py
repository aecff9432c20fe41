"""`sglang-offload bench serve`: time to first token of a real server, cold vs from each cache tier.

For each prompt length (exact, as `input_ids`, so any model serves it), `--repeat` different
prompts, each sent cold (a fresh store, nothing cached) and again (an L1/L2 hit: SGLang's device
and host pools). Then a restart on the same store (L1/L2 empty) and, per prompt, an interleaved
triple on the restarted server (`offload.bench.serve_target`): a fresh prompt (cold), the prompt
from before the restart (an L3 hit from the offload store), the same again (an L1/L2 hit), and
the raw disk's O_DIRECT read of that prefix's KV bytes, measured in between; every timed request
starts on a quiet server (`serve_target.settle`: the last one's write-back done). The L3 target:
the L3 hit's first token at most the L1/L2 hit's plus twice that raw read plus 30 ms (medians of
the triples), and where it is missed for a known cause, why (`serve_target.why_missed`: the
worth-it rule recomputed, or the prefill a hit saves is less than the load adds). Each reply's
cached tokens are recorded, and the store's blocks and bytes; each hit's reply is compared with
the cold reply of its prompt at the logprob (`offload.agree.compare`: chosen tokens and top-5
within the model's measured tolerance, `offload.agree.tolerance_for`), per phase `agreement`
(the worst verdict, the largest |delta logprob|, the top-k mismatches; `same_output` = not
"different", kept for older readers), and the run's own
cold-vs-L1/L2 spread is reported beside the tolerance (`spread`); a "different" exits 1. The
servers compute the lm head in float32 (`enable-fp32-lm-head` in the deployment copy: bf16
logits move in steps too coarse to compare). A short warm-up prompt goes through each phase
first (the first load from the store pays one-off costs: its time is reported apart,
`first_l3_request_s`; `native_hash_at_start`: each started server's line on SGLang's page-hash
extension, built or loaded before it answered). `--kv-cache-dtype` starts the servers with that
KV cache dtype over the deployment file's (`fp8_e4m3`: half the bytes of bf16 per page, on the CPU
with patches/0017); the dtype the server reports and the store's bytes per block are the figure
beside the times, so a bf16 run and an fp8 run of the same lengths compare bytes and time.
A restart that fails (the server does not come
back, or dies during the triples) is reported, not dropped: the rows measured before it stay,
each length without its L3 target says `l3_failed` with the reason, and the command exits 1.
The server: started from
`--config FILE` through `sglang-offload launch` (a free loopback port and a private store under
`--dir`, removed at the end), or one already running at `--url` (no restart there: cold and L1/L2
only; fresh prompts make the cold row cold).

On a wheel without patches/0008 (SGLang's own torch_native, the CPU backend) a note says that
attention is recomputed over the whole prompt even when the prefix is cached, which hides the
gain. `--plot` and `bench plot` draw the result with `offload.bench.plot` (bars per length: time
to first token per phase, speed-up over cold).
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from offload.agree import TOLERANCE, tolerance_for
from offload.argtypes import count, names, positive, work_dir
from offload.bench.common import JSON, Args, Option, Outcome, scratch
from offload.bench.serve_target import (
    agreement,
    has_patch,
    raw_read_s,
    settle,
    spread,
    store_blocks,
    triple_prompts,
    verdict,
    why_missed,
)
from offload.errors import RunError, UsageError
from offload.launch.server import LaunchedServer, Reply, free_port, store_usage, wait_store

PHASES = ("cold", "l1l2", "l3")
RESTARTED = ("cold_restarted", "l1l2_restarted")   # the triples' fresh prompt and repeated hit
WARM = 512            # tokens of the warm-up prompt, sent through each phase before any timing
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2")
TORCH_NATIVE_NOTE = ("this SGLang lacks patches/0008: its torch_native attention recomputes "
                     "attention over the whole prompt even when the prefix is cached "
                     "(srt/layers/attention/torch_native_backend.py _run_sdpa_forward_extend): "
                     "a hit saves the cached tokens' projections and MLPs, not their attention, "
                     "which hides the gain")


def _lengths(text: str) -> str:
    for part in text.split(","):
        if count(part.strip()) < 128:
            raise ValueError(f"{part.strip()} tokens: use at least 128")
    return text


OPTIONS = (
    Option(("--config",), "deployment YAML to start the server from (sglang-offload launch)",
           metavar="FILE"),
    Option(("--url",), "a running server (http://127.0.0.1:PORT) instead of --config: cold and "
           "L1/L2 only, no restart", metavar="URL"),
    Option(("--lengths",), "prompt lengths in tokens (comma-separated; on a GPU host up to "
           "131072)", "2048,4096,8192", _lengths),
    Option(("--max-new-tokens",), "tokens generated per request (greedy)", 8, count),
    Option(("--repeat",), "prompts per length (each through every phase; medians reported)", 3,
           count),
    Option(("--dir",), "where the private store goes (default: $TMPDIR)", None, work_dir),
    Option(("--start-timeout",), "seconds a server start may take", 600.0, positive),
    Option(("--phases",), "which to measure", "cold,l1l2,l3", names("cold", "l1l2", "l3")),
    Option(("--seed",), "seed of the prompts' token ids; 0: a new one each run, so a server "
           "that saw earlier runs still starts cold", 0, int),
    Option(("--kv-cache-dtype",), "the servers' KV cache dtype (SGLang's kv-cache-dtype, over the "
           "deployment file's; with --config): fp8_e4m3 stores half the bytes of bf16 per page; "
           "reported with the store's bytes per block", None, choices=KV_CACHE_DTYPES,
           metavar="DTYPE"),
    JSON,
)


def _server_info(server: LaunchedServer) -> dict[str, Any]:
    try:
        info = json.loads(server.get("/get_server_info"))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def native_hash_at_start(server: LaunchedServer) -> str | None:
    """The backend's line on SGLang's page-hash extension in a started server's log (built or
    loaded at start, `offload.hicache.native_hash`), or None."""
    try:
        text = server.log.read_text(errors="replace")
    except OSError:
        return None
    found = re.search(r"offload: SGLang's page-hash extension \S+ [^\n]*", text)
    return found.group(0) if found else None


def _prompt(length: int, seed: int) -> list[int]:
    """Token ids in [10, 250): every model's vocabulary has them (the demo's byte tokens)."""
    r = random.Random(seed * 1_000_003 + length)
    return [r.randrange(10, 250) for _ in range(length)]


def deployment(src: str, store: Path, port: int, sglang: dict[str, Any] | None = None,
               name: str = "bench-serve.yaml") -> Path:
    """A copy of the deployment file `src` (written beside `store` as `name`) on a loopback
    `port`, the cache report on, the lm head in float32 (`enable-fp32-lm-head`: logprobs fine
    enough for `offload.agree`), its store at `store`, and `sglang` keys (SGLang's own
    arguments) set over the file's: `bench serve` and `bench workload` start servers from it."""
    try:
        doc = yaml.safe_load(Path(src).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--config {src}: cannot read it ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("sglang"), dict):
        raise UsageError(f"--config {src}: expected a deployment file with a sglang: section")
    doc["sglang"] = {**doc["sglang"], **(sglang or {}), "host": "127.0.0.1", "port": port,
                     "enable-cache-report": True, "enable-fp32-lm-head": True}
    off = doc.get("offload") or {}
    if not isinstance(off, dict) or not isinstance(off.get("store") or {}, dict):
        raise UsageError(f"--config {src}: offload: and offload.store: must be mappings")
    kept = {k: v for k, v in (off.get("store") or {}).items() if k != "paths"}   # one directory
    off["store"] = {**kept, "path": str(store)}
    doc["offload"] = off
    out = store.parent / name
    # private: the copy may hold the file's secrets (a salt, a Redis password, an admin key),
    # and launch refuses a config holding one that others can read
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(yaml.safe_dump(doc, sort_keys=False))
    return out


def run(args: Args) -> Outcome:
    if bool(args.config) == bool(args.url):
        raise UsageError("give one of --config FILE (start a server) or --url URL (a running one)")
    if args.url and args.kv_cache_dtype:
        raise UsageError("--kv-cache-dtype starts the servers with that dtype: use it with "
                         "--config (the server at --url keeps its own)")
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    phases = set(args.phases.split(","))
    if args.url and "l3" in phases:
        print("note: --url: no restart, so no L3 row (use --config)", file=sys.stderr)
        phases.discard("l3")
    phases.add("cold")
    seed = args.seed if args.seed else int(time.time())    # fresh prompts: the cold row is cold
    result: dict[str, Any] = {"lengths": lengths, "max_new_tokens": args.max_new_tokens,
                              "rows": {str(n): {} for n in lengths}, "seed": seed}
    with scratch(args.dir, "bench-serve-") as work:       # the store, the config, the logs
        _measure(args, Path(work), lengths, phases, seed, result)
    _print(result)
    if args.json:
        print(json.dumps(result, indent=2))
    bad = [n for n, row in result["rows"].items() for p in row.values()
           if isinstance(p, dict) and (p.get("agreement") or {}).get("verdict") == "different"]
    return Outcome(result, 1 if bad or "l3_failed" in result else 0)


def _summary(replies: list[Reply], cold: list[Reply] | None, tolerance: float = TOLERANCE
             ) -> dict[str, Any]:
    """The median time to first token of a phase's tries, with what every try got."""
    out: dict[str, Any] = {"ttft_s": round(statistics.median(r.ttft_s for r in replies), 4),
                           "ttft_tries_s": [round(r.ttft_s, 4) for r in replies],
                           "cached_tokens": min(r.cached_tokens for r in replies),
                           "cached_details": replies[0].details}
    if cold is not None:
        out["agreement"] = agreement(replies, cold, tolerance)
        out["same_output"] = out["agreement"]["verdict"] != "different"
    return out


def _measure(args: Args, work: Path, lengths: list[int], phases: set[str], seed: int,
             result: dict[str, Any]) -> None:
    store = work / "store"
    prompts = {n: [_prompt(n, seed + 7919 * k) for k in range(args.repeat)] for n in lengths}
    warm = _prompt(WARM, seed - 1)
    if args.url:
        server = LaunchedServer.at(args.url)
        cfg, url = Path(), args.url
    else:
        port = free_port()
        kv = {"kv-cache-dtype": args.kv_cache_dtype} if args.kv_cache_dtype else None
        cfg = deployment(args.config, store, port, kv)
        url = f"http://127.0.0.1:{port}"
        server = LaunchedServer.start(cfg, work / "server-1.log", url)
    servers = [server]
    tries: dict[str, dict[int, list[Reply]]] = {p: {n: [] for n in lengths}
                                                for p in (*PHASES, *RESTARTED)}
    try:
        if not args.url:
            server.wait_ready(args.start_timeout)
        info = _server_info(server)
        result["server"] = {k: info.get(k) for k in ("attention_backend", "device",
                                                     "hicache_storage_prefetch_policy",
                                                     "hicache_mem_layout", "hicache_io_backend",
                                                     "page_size", "model_path",
                                                     "kv_cache_dtype")}
        ctx = info.get("context_length")
        too_long = [n for n in lengths if isinstance(ctx, int) and n + args.max_new_tokens > ctx]
        if too_long:
            raise RunError(f"bench serve: --lengths {','.join(map(str, too_long))}: a prompt of "
                           f"that many tokens plus --max-new-tokens {args.max_new_tokens} exceeds "
                           f"the server's context-length {ctx}; use at most "
                           f"{ctx - args.max_new_tokens}")
        if info.get("attention_backend") == "torch_native" and not has_patch("0008-"):
            result["note"] = TORCH_NATIVE_NOTE
        for _ in range(2):                       # warm-up: the cold and the L1/L2 path once
            server.generate(warm, args.max_new_tokens)
        page = int(result["server"].get("page_size") or 64)
        for n in lengths:
            for ids in prompts[n]:
                watch = None if args.url else store
                until = store_blocks(watch) + (n - 1) // page
                tries["cold"][n].append(server.generate(ids, args.max_new_tokens))
                if "l1l2" in phases:       # each timed request starts on a quiet server
                    settle(watch, until)
                    tries["l1l2"][n].append(server.generate(ids, args.max_new_tokens))
                    settle(None, 0)
            print(f"  {n} tokens: cold and L1/L2 done", file=sys.stderr)
        if "l3" in phases:
            wait_store(store, sum((n - 1) // page * args.repeat for n in lengths)
                       + (WARM - 1) // page)
            server.stop()
            server = LaunchedServer.start(cfg, work / "server-2.log", url)
            servers.append(server)
            try:
                server.wait_ready(args.start_timeout)
                # the first load from the store pays one-off costs: it is timed and reported,
                # not counted in the rows
                result["first_l3_request_s"] = round(server.generate(warm, args.max_new_tokens)
                                                     .ttft_s, 3)
                _triples(args, server, store, lengths, prompts, seed, page, tries, result)
            except (RunError, OSError) as e:   # the rows measured so far stay, the failure named
                print(f"--- {server.log} (last lines) ---\n{server.tail()}", file=sys.stderr)
                result["l3_failed"] = (f"the restarted server failed: {e}" if isinstance(e, OSError)
                                       else str(e))
        tol = tolerance_for(result["server"].get("model_path"))     # the demo's is tighter
        for n in lengths:
            row = result["rows"][str(n)]
            row["cold"] = _summary(tries["cold"][n], None)
            for p in ("l1l2", "l3", "l1l2_restarted"):
                if tries[p][n]:
                    row[p] = _summary(tries[p][n], tries["cold"][n], tol)
                    row[p]["speedup"] = (round(row["cold"]["ttft_s"] / row[p]["ttft_s"], 3)
                                         if row[p]["ttft_s"] > 0 else None)
            if tries["cold_restarted"][n]:
                row["cold_restarted"] = _summary(tries["cold_restarted"][n], None)
            if row.get("l1l2_restarted") and row.get("raw_read_s_tries"):
                row["target"] = verdict(row["l1l2_restarted"]["ttft_s"], row["l3"]["ttft_s"],
                                        statistics.median(row["raw_read_s_tries"]))
                why = why_missed(row, n, servers[-1].log)
                if why:
                    row["target"]["why_missed"] = why
            if "l3_failed" in result and not row.get("target"):
                row["l3_failed"] = result["l3_failed"]
        result["spread"] = spread(result["rows"], tol)
        blocks, data = store_usage(store) if not args.url else (None, None)
        result["store"] = {"blocks": blocks, "data_bytes": data,
                           "block_bytes": data // blocks if blocks and data else None}
    except (RunError, OSError) as e:
        if server.proc is not None:        # the log goes with the scratch directory: show it
            print(f"--- {server.log} (last lines) ---\n{server.tail()}", file=sys.stderr)
        if isinstance(e, RunError):
            raise
        raise RunError(f"bench serve: the server at {server.url} failed: {e}") from None
    finally:
        result["native_hash_at_start"] = [native_hash_at_start(s) for s in servers
                                          if s.proc is not None]
        for s in servers:
            s.stop()


def _triples(args: Args, server: LaunchedServer, store: Path, lengths: list[int],
             prompts: dict[int, list[list[int]]], seed: int, page: int,
             tries: dict[str, dict[int, list[Reply]]], result: dict[str, Any]) -> None:
    """Per prompt, on the restarted server: a fresh prompt (cold), the prompt from before the
    restart (L3), the same again (L1/L2), then the raw disk's O_DIRECT read of that L3 hit's KV
    bytes (its pages times the store's mean block size) in the store's directory."""
    blocks, data = store_usage(store)
    block_bytes = data // blocks if blocks else 0
    result["store_block_bytes"] = block_bytes
    for n in lengths:
        raws: list[float] = []
        result["rows"][str(n)]["raw_read_s_tries"] = raws   # filled as the triples go
        for ids, fresh in zip(prompts[n], triple_prompts(n, seed, args.repeat)):
            until = store_blocks(store) + (n - 1) // page
            tries["cold_restarted"][n].append(server.generate(fresh, args.max_new_tokens))
            settle(store, until)                # each timed request starts on a quiet server
            hit = server.generate(ids, args.max_new_tokens)
            tries["l3"][n].append(hit)
            settle(None, 0)
            tries["l1l2_restarted"][n].append(server.generate(ids, args.max_new_tokens))
            settle(None, 0)
            raws.append(round(raw_read_s(str(store), hit.cached_tokens // page * block_bytes), 5))
        print(f"  {n} tokens: {len(raws)} triples after the restart done", file=sys.stderr)


def _fmt(d: dict[str, Any], key: str, fmt: str) -> str:
    v = d.get(key)
    return format(v, fmt) if isinstance(v, (int, float)) else "-"


def _print(result: dict[str, Any]) -> None:
    srv = result.get("server", {})
    print(f"bench serve: {srv.get('model_path')} on {srv.get('device')}, attention "
          f"{srv.get('attention_backend')}, page {srv.get('page_size')} tokens, KV cache "
          f"{srv.get('kv_cache_dtype')}")
    print(f"{'tokens':>8} {'cold s':>8} {'L1/L2 s':>8} {'x':>6} {'cached':>7} "
          f"{'L3 s':>8} {'x':>6} {'cached':>7} {'max |d|':>8} {'answer':>9}")
    for n, row in result["rows"].items():
        c, a, b = row.get("cold", {}), row.get("l1l2", {}), row.get("l3", {})
        f = _fmt
        ags = [p["agreement"] for p in row.values() if isinstance(p, dict) and "agreement" in p]
        worst = {"d": max((g["max_delta"] for g in ags), default=None)}
        said = next((v for v in ("different", "near-tie", "same")
                     if any(g["verdict"] == v for g in ags)), "-")
        print(f"{n:>8} {f(c, 'ttft_s', '.3f'):>8} {f(a, 'ttft_s', '.3f'):>8} "
              f"{f(a, 'speedup', '.2f'):>6} {f(a, 'cached_tokens', 'd'):>7} "
              f"{f(b, 'ttft_s', '.3f'):>8} {f(b, 'speedup', '.2f'):>6} "
              f"{f(b, 'cached_tokens', 'd'):>7} {f(worst, 'd', '.4f'):>8} "
              f"{said.upper() if said == 'different' else said:>9}")
    sp = result.get("spread") or {}
    if sp:
        print(f"answers at the logprob (chosen token and top-5, each hit against its prompt's cold "
              f"reply): largest |delta| vs L1/L2 {_fmt(sp, 'l1l2_max_delta', '.4f')} (this "
              f"run's own spread), vs L3 {_fmt(sp, 'l3_max_delta', '.4f')}; tolerance "
              f"{sp['tolerance']:.4f} nats (docs/design/agreement.md)"
              + (f"; {sp['note']}" if sp.get("note") else ""))
    for n, row in result["rows"].items():
        for phase, p in row.items():
            for line in (p.get("agreement") or {}).get("why", []) if isinstance(p, dict) else []:
                print(f"{n} tokens, {phase}: {line}")
    for n, row in result["rows"].items():
        t = row.get("target")
        if t:
            print(f"L3 target at {n} tokens (restarted server, medians of "
                  f"{len(row['raw_read_s_tries'])} triples): cold "
                  f"{row['cold_restarted']['ttft_s']:.3f} s, L3 {t['l3_s']:.3f} s, L1/L2 "
                  f"{t['l1l2_s']:.3f} s, raw read {1000 * t['raw_read_s']:.1f} ms; limit "
                  f"{t['limit_s']:.3f} s (L1/L2 + 2 x raw + 30 ms): "
                  f"{'met' if t['met'] else 'MISSED'} (L3 - L1/L2 = "
                  f"{1000 * t['l3_extra_s']:.0f} ms)"
                  + (f"; why: {t['why_missed']}" if t.get("why_missed") else ""))
    for n, row in result["rows"].items():
        if row.get("l3_failed"):
            print(f"L3 at {n} tokens: FAILED, {row['l3_failed']} (the rows above were measured "
                  "before it)")
    st = result.get("store") or {}
    if st.get("blocks") is not None:
        print(f"store: {st['blocks']} blocks, {st['data_bytes']} bytes"
              + (f" ({st['block_bytes']} bytes per block, KV cache {srv.get('kv_cache_dtype')})"
                 if st.get("block_bytes") else ""))
    if result.get("note"):
        print(f"note: {result['note']}")

