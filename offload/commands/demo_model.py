"""`sglang-offload demo-model DIR [--family F] [--layers N ...] [--seed N] [--force]`: write the demo model.

A small checkpoint with RANDOM weights and a tokenizer made here (no network), for serving on a
CPU box (`offload.demo`): a Llama by default, or another family of `offload.demo.FAMILIES`
(`--family mla|swa`). Prints the files and the next step. Exit 2 on a bad option or an
unwritable / non-empty DIR.
"""

from __future__ import annotations

import argparse
import dataclasses

from offload.demo import FAMILIES, DemoSpec
from offload.demo.checkpoint import NOTICE
from offload.demo.spec import DTYPES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = NOTICE
    p.add_argument("dir", metavar="DIR", help="where to write the checkpoint (new or empty)")
    p.add_argument("--family", default="llama", choices=sorted(FAMILIES),
                   help="the architecture, each with random weights: "
                        + "; ".join(f"{name}: {f.about}" for name, f in FAMILIES.items())
                        + " (default %(default)s)")
    d = DemoSpec()
    for f in dataclasses.fields(DemoSpec):
        if f.name == "dtype":
            p.add_argument("--dtype", default=d.dtype, choices=DTYPES,
                           help="weight and KV dtype (default %(default)s)")
        else:
            p.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=getattr(d, f.name),
                           metavar="N", help="default %(default)s")
    p.add_argument("--force", action="store_true", help="write into a non-empty DIR")


def run(args: argparse.Namespace) -> int:
    spec = DemoSpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DemoSpec)})
    files = FAMILIES[args.family].write(args.dir, spec, overwrite=args.force)
    print(f"wrote {args.dir} ({args.family}): {', '.join(f.name for f in files)}")
    print(f"note: {NOTICE}")
    print(f"next: set sglang.model-path: {args.dir} in your config (configs/cpu-dev.yaml uses "
          "/tmp/sglang-offload-demo), then sglang-offload launch --config FILE")
    return 0
