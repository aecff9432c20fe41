"""`sglang-offload bench TARGET [options]`: dispatch to one benchmark module, imported on use.

Each benchmark module declares its options as data (`OPTIONS`: `offload.bench.common.Option`s,
turned into argparse flags here by `add_options`) and has `run(args) -> Outcome` (its result and
exit code). `--plot OUT.png` (among the target's options) hands that result to
`offload.bench.plot.draw`: throughput against block size per path, with the raw baseline.
`bench plot RESULT.json --plot OUT.png` draws a result saved with `--json`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Sequence

from offload.bench import plot
from offload.bench.common import Option
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


def add_options(p: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    """A benchmark's declared options as argparse flags."""
    for o in options:
        kw: dict[str, Any] = {"help": o.help}
        if o.flag:
            kw["action"] = "store_true"
        else:
            kw["default"] = o.default
            if o.type is not None:
                kw["type"] = o.type
            if o.choices is not None:
                kw["choices"] = list(o.choices)
            if o.metavar is not None:
                kw["metavar"] = o.metavar
        if o.required:
            kw["required"] = True
        p.add_argument(*o.flags, **kw)


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
    add_options(bp, module.OPTIONS)
    if args.target == "plot":
        return int(module.run(bp.parse_args(args.options)).rc)
    out, options = split_plot(args.options)
    outcome = module.run(bp.parse_args(options))
    if out:
        if outcome.result is None:
            raise OffloadError(f"bench {args.target} produced no result to plot")
        print(f"plot: {plot.draw(outcome.result, out)}", file=sys.stderr)
    return int(outcome.rc)
