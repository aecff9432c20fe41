"""Small L3 hits with the worth-it rule on (prefill speed measured) against off, one session.

Servers started through `sglang-offload launch` on the demo model (CPU), one at a time, each with its own
store: A with the rule on and nothing configured (the prefill speed measured from the first
requests), B with `offload.worth_it.enabled: false` (every hit loaded, SGLang's behaviour). Both
get one 1,024-token warm-up prompt (a miss: A measures its prefill from it; the first prefetch
JIT-builds SGLang's hash extension). Rounds alternate A B, B A, ... (a HiCache server wants SGLang's
10 GiB host reserve free, so two at once do not fit a small box); per prompt length each server
gets a new prompt cold (computed, backed up to its store), its L1/L2 flushed
(`/flush_cache`), and the same prompt again: the L3 hit, or on A a recompute when the rule
declines it. Printed: per length the medians of cold and repeated TTFT on A and B, the hits A
skipped, and B - A (time the rule saved); A's threshold from its log; outputs checked equal.

    .venv/bin/python scripts/bench_worth_it.py --lengths 256,512,768,1536 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from offload.launch.server import LaunchedServer, free_port, store_usage, wait_store  # noqa: E402

PAGE = 64


def _config(path: Path, model: Path, store: Path, port: int, rule: bool) -> Path:
    doc = {"sglang": {"model-path": str(model), "device": "cpu", "page-size": PAGE,
                      "context-length": 16384, "max-total-tokens": 32768, "hicache-ratio": 4,
                      "enable-cache-report": True, "host": "127.0.0.1", "port": port,
                      "log-level": "info"},
           "offload": {"store": {"path": str(store), "capacity": "1GiB", "min_free": "0",
                                 "io_threads": 2}, "metrics": {"enabled": False},
                       "worth_it": {"enabled": rule}}}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _prompt(tokens: int, seed: int) -> str:
    """About `tokens` demo tokens of made-up words (most are one token), new for every seed."""
    import random

    from offload.demo.tokenizer import _WORDS

    r = random.Random(seed)
    return f"[{seed}]" + " ".join(r.choice(_WORDS) for _ in range(tokens))


def _flush(server: LaunchedServer) -> None:
    req = urllib.request.Request(server.url + "/flush_cache", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()


def _cold_then_l3(server: LaunchedServer, store: Path, ids: str) -> tuple:
    before = store_usage(store)[0]                # before the request: its write-back is async
    cold = server.generate(ids, max_new_tokens=4)
    wait_store(store, before + (cold.prompt_tokens - 1) // PAGE)   # the write-back landed
    _flush(server)                                # L1 and L2 empty: the next hit is L3's
    again = server.generate(ids, max_new_tokens=4)
    return cold, again


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="256,512,768,1536")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", type=Path, help="demo model dir (default: made in a tmp dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-worth-it-"))
    model = args.model
    if model is None:
        from offload.demo import DemoSpec, write_demo

        model = tmp / "model"
        write_demo(model, DemoSpec())
    rows: dict[tuple[str, int], list[tuple]] = {}
    thresholds: list[str] = []
    order = [("A", True), ("B", False)]
    for rnd in range(args.rounds):                 # A B, B A, A B, ...: one server at a time
        for name, rule in order if rnd % 2 == 0 else order[::-1]:
            port, store = free_port(), tmp / f"store-{name}"
            cfg = _config(tmp / f"{name}-{rnd}.yaml", model, store, port, rule)
            log = tmp / f"{name}-{rnd}.log"
            s = LaunchedServer.start(cfg, log, f"http://127.0.0.1:{port}",
                                     env={"UCX_MODULES": "^ib"})
            try:
                s.wait_ready(600)
                _cold_then_l3(s, store, _prompt(1024, 999 + rnd))    # warm-up (a miss)
                for length in lengths:
                    cold, again = _cold_then_l3(s, store, _prompt(length, 1000 * rnd + length))
                    assert again.output_ids == cold.output_ids, (name, length, rnd)
                    rows.setdefault((name, length), []).append(
                        (cold.ttft_s, again.ttft_s, again.details.get("storage", 0),
                         cold.prompt_tokens))
                    print(f"# round {rnd} {name} {cold.prompt_tokens} tokens: cold "
                          f"{cold.ttft_s:.3f} s, again {again.ttft_s:.3f} s, storage tokens "
                          f"{again.details.get('storage', 0)}", file=sys.stderr, flush=True)
            finally:
                s.stop(grace=20)
            if rule:
                thresholds += re.findall(r"offload: worth-it threshold .*",
                                         log.read_text(errors="replace"))
    try:
        out = []
        for length in lengths:
            a, b = rows[("A", length)], rows[("B", length)]
            med = lambda xs: statistics.median(xs)  # noqa: E731
            out.append({"tokens": a[0][3],
                        "A_cold_s": med([r[0] for r in a]), "A_again_s": med([r[1] for r in a]),
                        "A_skipped": sum(1 for r in a if r[2] == 0), "tries": len(a),
                        "B_cold_s": med([r[0] for r in b]), "B_l3_s": med([r[1] for r in b]),
                        "B_l3_hits": sum(1 for r in b if r[2] > 0),
                        "saved_s": med([r[1] for r in b]) - med([r[1] for r in a])})
        if args.json:
            print(json.dumps({"rows": out, "thresholds": thresholds}, indent=1))
        else:
            print("tokens  A cold   A again  A skipped  B cold   B L3 hit  B L3 hits  B-A (s)")
            for r in out:
                print(f"{r['tokens']:>6}  {r['A_cold_s']:7.3f}  {r['A_again_s']:7.3f}  "
                      f"{r['A_skipped']:>3}/{r['tries']:<5}  {r['B_cold_s']:7.3f}  "
                      f"{r['B_l3_s']:8.3f}  {r['B_l3_hits']:>3}/{r['tries']:<5}  "
                      f"{r['saved_s']:+.3f}")
            print("A's thresholds, in order:", *thresholds, sep="\n  ")
        return 0
    finally:
        print(f"logs: {tmp}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
