"""`sglang-offload bench TARGET [options]`: dispatch to one benchmark module, imported on use.

Each benchmark module declares its options as data (`OPTIONS`: `offload.bench.common.Option`s,
turned into argparse flags here by `add_options`, each value checked by its `type` while parsing,
so a bad one is an `error:` line before any work) and has `run(args) -> Outcome` (its result and
exit code). Every target but `plot` also takes `--plot OUT.png` (checked before the run: the
directory exists and is writable, matplotlib writes the format; its help says what that target's
plot shows, `PLOTS`), which hands the result to `offload.bench.plot.draw`. `bench plot RESULT.json
--plot OUT.png` draws a result saved with `--json`, whichever target made it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys
from typing import Any, Sequence

from offload import redact
from offload.argtypes import arg
from offload.bench import plot
from offload.bench.common import PLOT, Option
from offload.errors import RunError

log = logging.getLogger("offload.bench")
# metavar shown by --help for each value check of offload.argtypes
METAVARS = {"count": "N", "natural": "N", "positive": "X", "size": "SIZE", "size_list": "LIST",
            "names": "LIST", "work_dir": "DIR", "plot_file": "OUT.png"}

BENCHES: dict[str, tuple[str, str]] = {
    "store": ("offload.bench.store", "block store vs raw O_DIRECT disk bandwidth"),
    "hicache": ("offload.bench.hicache", "our HiCache backend vs SGLang's stock file backend"),
    "contend": ("offload.bench.contend", "an L3 read beside a saturating write-back vs the "
                "raw drive's read beside a raw writer (p50 / p90)"),
    "redis": ("offload.bench.redis", "Redis tier vs raw Redis throughput"),
    "paths": ("offload.bench.paths", "each transfer path vs raw disk and NIXL loopback"),
    "serve": ("offload.bench.serve", "time to first token of a real server: cold vs L1/L2 vs L3"),
    "workload": ("offload.bench.workload", "many users, shared prefixes, multi-turn on SGLang's "
                 "own client: no L3 vs SGLang's file L3 vs ours, across a restart"),
    "plot": ("offload.bench.plot", "plot a saved --json result (--plot OUT.png)"),
}
# what `--plot` draws, per target (the help of its --plot)
PLOTS: dict[str, str] = {
    "store": "block store put / cold get / warm get vs the raw O_DIRECT disk, GB/s against block "
             "size",
    "hicache": "our backend vs SGLang's file backend vs the raw disk, GB/s at the page size (bars)",
    "contend": "read latency p50 / p90 (bars): the raw drive and our backend, each alone and "
               "beside writes, with the target as a line",
    "redis": "the Redis tier vs raw redis-py, GB/s against block size (bars for one size)",
    "paths": "each transfer path vs raw disk and NIXL loopback, GB/s against block size",
    "serve": "time to first token per prompt length (cold, L1/L2 hit, L3 hit) and the hits' "
             "speed-up over cold, as bars",
    "workload": "TTFT p50 / p90 per tier before and after the restart (bars), or with "
                "--sweep-users the p90 TTFT per user count against the target",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("targets: " + "; ".join(f"{k}: {v[1]}" for k, v in BENCHES.items())
                     + ". `bench TARGET --help` lists a target's options and defaults.")
    p.add_argument("target", choices=sorted(BENCHES), help="what to measure")
    p.add_argument("options", nargs=argparse.REMAINDER,
                   help="options of that benchmark (bench TARGET --help), and --plot OUT.png to "
                        "draw the result (what it shows: bench TARGET --help)")


def add_options(p: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    """A benchmark's declared options as argparse flags, each shown with its default."""
    for o in options:
        help_text = o.help.replace("%", "%%")
        kw: dict[str, Any] = {}
        if o.flag:
            kw["action"] = "store_true"
        else:
            kw["default"] = o.default
            if o.default is not None and "default" not in o.help:
                help_text += f" (default: {o.default})"
            if o.type is not None:
                kw["type"] = arg(o.type)
            if o.choices is not None:
                kw["choices"] = list(o.choices)
            metavar = o.metavar or METAVARS.get(getattr(o.type, "__name__", ""))
            if metavar is not None and o.flags[0].startswith("-"):
                kw["metavar"] = metavar
        if o.required:
            kw["required"] = True
        p.add_argument(*o.flags, help=help_text, **kw)


def parser_of(target: str) -> argparse.ArgumentParser:
    """The parser of `bench TARGET`'s own options (with `--plot` for every target but plot)."""
    module = importlib.import_module(BENCHES[target][0])
    bp = argparse.ArgumentParser(prog=f"sglang-offload bench {target}",
                                 description=BENCHES[target][1])
    if target == "plot":
        add_options(bp, module.OPTIONS)
    else:
        help_text = (f"draw the result as an image: {PLOTS[target]}; the directory must exist, "
                     "the extension names the format")
        add_options(bp, (*module.OPTIONS, dataclasses.replace(PLOT, help=help_text)))
    return bp


def run(args: argparse.Namespace) -> int:
    bp = parser_of(args.target)
    opts = bp.parse_args(args.options)
    for action in bp._actions:        # argparse hands `--opt=--` over as [], unchecked
        if action.option_strings and isinstance(getattr(opts, action.dest, None), list):
            bp.error(f"argument {action.option_strings[0]}: expected one value, not '--'")
    log.debug("bench %s: %s", args.target, redact.text(str(vars(opts))))
    module = importlib.import_module(BENCHES[args.target][0])
    outcome = module.run(opts)
    out = getattr(opts, "plot", None) if args.target != "plot" else None
    if out:
        if outcome.result is None:
            raise RunError(f"bench {args.target} produced no result to plot")
        print(f"plot: {plot.draw(outcome.result, out)}", file=sys.stderr)
    return int(outcome.rc)
