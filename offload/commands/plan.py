"""`sglang-offload plan`: KV-cache sizing (the model is `offload.plan.model`).

The tier's read bandwidth is `--drives` x `--read-gbps` (one Gen4 NVMe by default), or with
`--config` the combined bandwidth of the distinct drives under `offload.store.paths` (or `path`),
detected under `--root` (`offload.hw.drive_set.read_bandwidth`: the sum of their PCIe links;
directories sharing a device count once). Detection here runs no live probe (no NVML, no tools).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from offload.commands.argtypes import arg, count, natural, positive
from offload.config import Size
from offload.errors import ConfigError
from offload.plan.model import (
    DEFAULT_ACTIVE_FRACTION,
    DEFAULT_MEM_FRACTION,
    DEFAULT_MFU,
    DEFAULT_READ_GBPS,
    KV_DTYPES,
    WEIGHT_DTYPES,
    PlanInputs,
    format_table,
    make_plan,
    parse_count,
    parse_dtype,
    parse_tokens,
)
from offload.plan.presets import GPUS, MODELS, find_gpu, load_architecture


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("KV-cache sizing: bytes per token and per user, users that fit in HBM after "
                     "the weights, users served with an offload tier, and whether loading a cached "
                     "prefix beats recomputing it.")
    p.add_argument("--model", default="Llama-3.1-70B",
                   help=f"preset ({', '.join(MODELS)}) or path of a HuggingFace config.json "
                   "(default: %(default)s)")
    p.add_argument("--params", help="parameter count (70.6B, 70553706496); default: the preset's, "
                   "or estimated from config.json")
    p.add_argument("--gpu", default="B200", help=f"GPU preset ({', '.join(GPUS)}; default B200)")
    p.add_argument("--gpu-mem", metavar="SIZE", help="memory per GPU, overriding the preset (96GiB, 80GB)")
    p.add_argument("--mem-fraction", type=float, default=DEFAULT_MEM_FRACTION,
                   help="share of GPU memory for weights + KV (SGLang --mem-fraction-static; "
                   "default %(default)s)")
    p.add_argument("--kv-dtype", default="bf16", help="bf16, fp16 or fp8 (default %(default)s)")
    p.add_argument("--weight-dtype", default="bf16",
                   help="bf16, fp16, fp8, int8 or int4 (default %(default)s)")
    p.add_argument("--context", default="128K", metavar="TOKENS",
                   help="tokens per user: 131072 or 128K (x1024) (default %(default)s)")
    p.add_argument("--tp", type=arg(count), default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--gpus", type=arg(count), help="number of GPUs (default: --tp, one replica)")
    p.add_argument("--active-fraction", type=float, default=DEFAULT_ACTIVE_FRACTION,
                   help="share of users whose KV must be resident at once (default %(default)s)")
    p.add_argument("--tier-capacity", metavar="SIZE", help="NVMe / Redis capacity for the whole deployment "
                   "(e.g. 3.84TB); caps the users served with offload")
    p.add_argument("--users", type=arg(natural), help="target users for sizing the tier "
                   "(default: the users served with offload)")
    p.add_argument("--hit-rate", type=float, default=1.0,
                   help="share of returning users whose KV must be kept (default 1.0)")
    p.add_argument("--prefix-tokens", metavar="TOKENS", help="cached prefix length for load vs prefill "
                   "(default: --context)")
    p.add_argument("--read-gbps", type=arg(positive), default=None,
                   help=f"read bandwidth of one drive, GB/s (default {DEFAULT_READ_GBPS:g}: one "
                   "Gen4 NVMe); the tier reads --drives times that per replica")
    p.add_argument("--drives", type=arg(count), default=None,
                   help="distinct drives the tier reads from (default 1); their bandwidth adds up")
    p.add_argument("--config", metavar="FILE",
                   help="deployment YAML: the tier's bandwidth is the combined bandwidth of the "
                   "drives under offload.store.paths (or path), detected (instead of --read-gbps "
                   "and --drives)")
    p.add_argument("--root", default="/", metavar="DIR",
                   help="with --config: detect the drives under DIR (a fixture tree); default /")
    p.add_argument("--prefill-tps", type=arg(positive), help="prefill tokens/s per GPU (default: derived "
                   f"from the GPU's dense BF16 FLOPS at {DEFAULT_MFU * 100:.0f}%% utilisation)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def read_bandwidth(args: argparse.Namespace) -> tuple[float, int, str]:
    """(the tier's read GB/s per replica, distinct drives, how it was found): --config's drives,
    detected, or --drives x --read-gbps."""
    if args.config is None:
        per, n = args.read_gbps or DEFAULT_READ_GBPS, args.drives or 1
        return per * n, n, (f"{n} drives x {per:g} GB/s" if n > 1 else "")
    if args.read_gbps is not None or args.drives is not None:
        raise ConfigError(["--config takes the bandwidth from the configured drives; give it "
                           "or --read-gbps/--drives, not both"])
    from offload.config import load_file
    from offload.hw.detect import detect
    from offload.hw.drive_set import read_bandwidth as combined
    from offload.hw.live import Live

    cfg = load_file(args.config).offload
    facts = detect(cfg, root=args.root, live=Live(), env={})
    bw = combined(facts, list(facts.directories))
    if bw.gbps is None:
        return DEFAULT_READ_GBPS, 1, (f"{DEFAULT_READ_GBPS:g} GB/s assumed: offload.store is "
                                      f"{bw.text}")
    return bw.gbps, bw.drives, f"offload.store: {bw.text}"


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    gpu = find_gpu(args.gpu)
    if gpu is None:
        raise ConfigError([f"unknown GPU preset '{args.gpu}'; presets: {', '.join(GPUS)} "
                           "(--gpu-mem overrides a preset's memory)"])

    def size(flag: str, text: str | None) -> int | None:
        try:
            return None if text is None else int(Size.parse(text))
        except ValueError as e:
            raise ConfigError([f"{flag} '{text}': {e}"]) from e

    params = None if args.params is None else parse_count(args.params, "--params")
    arch, source = load_architecture(args.model, params)
    read, drives, how = read_bandwidth(args)
    return PlanInputs(
        arch=arch, gpu=gpu, context=parse_tokens(args.context, "--context"),
        kv_dtype=parse_dtype(args.kv_dtype, KV_DTYPES, "--kv-dtype"),
        weight_dtype=parse_dtype(args.weight_dtype, WEIGHT_DTYPES, "--weight-dtype"),
        tp=args.tp, gpus=args.gpus if args.gpus is not None else args.tp,
        gpu_mem=size("--gpu-mem", args.gpu_mem), mem_fraction=args.mem_fraction,
        active_fraction=args.active_fraction, tier_capacity=size("--tier-capacity",
                                                                 args.tier_capacity),
        target_users=args.users, hit_rate=args.hit_rate,
        prefix_tokens=(None if args.prefix_tokens is None
                       else parse_tokens(args.prefix_tokens, "--prefix-tokens")),
        read_gbps=read, prefill_tps=args.prefill_tps, model_source=source, read_drives=drives,
        read_source=how)


def run(args: argparse.Namespace) -> int:
    inp = inputs_from_args(args)
    plan = make_plan(inp)
    if args.json:
        print(json.dumps(asdict(plan), indent=2))
    else:
        print(format_table(plan, inp.arch))
    return 0
