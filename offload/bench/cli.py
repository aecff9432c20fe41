"""`sglang-offload bench TARGET [options]`: dispatch to one benchmark module, imported on use.

Each benchmark module exposes `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib

BENCHES: dict[str, tuple[str, str]] = {
    "store": ("offload.bench.store", "block store vs raw O_DIRECT disk bandwidth"),
    "hicache": ("offload.bench.hicache", "our HiCache backend vs SGLang's stock file backend"),
    "redis": ("offload.bench.redis", "Redis tier vs raw Redis throughput"),
    "paths": ("offload.bench.paths", "each transfer path vs raw disk and NIXL loopback"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "targets: " + "; ".join(f"{k}: {v[1]}" for k, v in BENCHES.items())
    p.add_argument("target", choices=sorted(BENCHES), help="what to measure")
    p.add_argument("options", nargs=argparse.REMAINDER, help="options of that benchmark (--help)")


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(BENCHES[args.target][0])
    bp = argparse.ArgumentParser(prog=f"sglang-offload bench {args.target}",
                                 description=BENCHES[args.target][1])
    module.add_arguments(bp)
    return int(module.run(bp.parse_args(args.options)) or 0)
