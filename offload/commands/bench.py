"""`sglang-offload bench TARGET [options]`: dispatch to one benchmark module, imported on use.

Each benchmark module exposes `add_arguments(parser)` and `run(args) -> int`, and hands its
result to `offload.bench.plot.emit`. `--plot OUT.png` (among the target's options) draws that
result: throughput against block size per path, with the raw baseline.
`bench plot RESULT.json --plot OUT.png` draws a result saved with `--json`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from offload.bench import plot
from offload.errors import OffloadError

BENCHES: dict[str, tuple[str, str]] = {
    "store": ("offload.bench.store", "block store vs raw O_DIRECT disk bandwidth"),
    "hicache": ("offload.bench.hicache", "our HiCache backend vs SGLang's stock file backend"),
    "redis": ("offload.bench.redis", "Redis tier vs raw Redis throughput"),
    "paths": ("offload.bench.paths", "each transfer path vs raw disk and NIXL loopback"),
    "plot": ("offload.bench.plot", "plot a saved --json result (--plot OUT.png)"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "targets: " + "; ".join(f"{k}: {v[1]}" for k, v in BENCHES.items())
    p.add_argument("target", choices=sorted(BENCHES), help="what to measure")
    p.add_argument("options", nargs=argparse.REMAINDER,
                   help="options of that benchmark (--help), and --plot OUT.png to draw "
                        "throughput vs block size with the raw baseline")


def split_plot(options: list[str]) -> tuple[str | None, list[str]]:
    """`--plot OUT` / `--plot=OUT` taken out of a benchmark's own options."""
    out: str | None = None
    rest: list[str] = []
    it = iter(options)
    for a in it:
        if a == "--plot":
            out = next(it, None)
            if out is None:
                raise OffloadError("--plot needs a file name (OUT.png)")
        elif a.startswith("--plot="):
            out = a.split("=", 1)[1]
        else:
            rest.append(a)
    return out, rest


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(BENCHES[args.target][0])
    bp = argparse.ArgumentParser(prog=f"sglang-offload bench {args.target}",
                                 description=BENCHES[args.target][1])
    module.add_arguments(bp)
    if args.target == "plot":
        return int(module.run(bp.parse_args(args.options)) or 0)
    out, options = split_plot(args.options)
    plot.take()                                   # nothing left over from an earlier run
    rc = int(module.run(bp.parse_args(options)) or 0)
    if out:
        result = plot.take()
        if result is None:
            raise OffloadError(f"bench {args.target} produced no result to plot")
        print(f"plot: {plot.draw(result[1], out)}", file=sys.stderr)
    return rc
