"""`sglang-offload plan`: KV-cache sizing (the model is `offload.plan.model`).

With `--config FILE` the deployment file gives every input it sets (`offload.plan.deployment`:
the model, tp-size, dp-size, context-length, kv-cache-dtype, mem-fraction-static, page-size,
hicache-size / hicache-ratio, store.capacity) and the GPU comes from detection under `--root`;
an option given on the command line wins over the file. The tier's read bandwidth is `--drives` x
`--read-gbps` (one Gen4 NVMe by default), or with `--config` and neither given, the combined
bandwidth of the distinct drives under `offload.store.paths` (or `path`), detected under `--root`
(`offload.hw.drive_set.read_bandwidth`: the sum of their PCIe links; directories sharing a device
count once), or with `--probe-io` their read rate measured now (`offload.hw.probe_io`).
Detection here runs no other live probe (no NVML, no tools). With the GPUs detected (planning on
the deployment's host) its MemTotal bounds the L2 pools, as `launch --dry-run` checks.
A deployment that cannot run (the weights or one context do not fit, the L2 pools past
`--host-mem`) is an `error:` line per reason and exit 1, after the table or the JSON (whose
`runnable` is false and `problems` says why).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from offload.argtypes import arg, count, positive
from offload.config import Size
from offload.errors import ConfigError, RunError
from offload.plan.deployment import Deployment, from_config
from offload.plan.model import (
    DEFAULT_L2_GBPS,
    DEFAULT_MEM_FRACTION,
    DEFAULT_MFU,
    DEFAULT_READ_GBPS,
    DEFAULT_THINK_S,
    DEFAULT_TTFT_S,
    DEFAULT_TURN_S,
    PlanInputs,
    make_plan,
)
from offload.plan.parse import (
    KV_DTYPES,
    MAX_TOKENS,
    WEIGHT_DTYPES,
    parse_count,
    parse_dtype,
    parse_tokens,
)
from offload.plan.presets import (
    GPUS,
    MODELS,
    GpuPreset,
    find_gpu,
    gpu_from_device_name,
    load_architecture,
)
from offload.plan.table import format_comment, format_table

if TYPE_CHECKING:
    from offload.hw.facts import Facts

DEFAULT_MODEL, DEFAULT_GPU, DEFAULT_CONTEXT = "Llama-3.1-70B", "B200", "128K"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("KV-cache sizing: bytes per token and per user, contexts that fit in HBM "
                     "after the weights, the L2 host pool, conversations carried within a TTFT "
                     "target with the L2 and the L3 behind HBM, and whether loading a cached "
                     "prefix beats recomputing it. Exits 1 when the deployment cannot run.")
    p.add_argument("--config", metavar="FILE",
                   help="deployment YAML: the model, tp-size, dp-size, context-length, "
                   "kv-cache-dtype, mem-fraction-static, page-size, hicache-size/-ratio, "
                   "store.capacity and the drives' combined bandwidth come from it (an option "
                   "given here wins)")
    p.add_argument("--root", default="/", metavar="DIR",
                   help="with --config: detect the GPUs and drives under DIR (a fixture tree); "
                   "default /")
    p.add_argument("--model", help=f"preset ({', '.join(MODELS)}), its HuggingFace id "
                   "(meta-llama/Llama-3.1-70B-Instruct) or path of a config.json (default: "
                   f"sglang.model-path, else {DEFAULT_MODEL})")
    p.add_argument("--params", help="parameter count (70.6B, 70553706496); default: the preset's, "
                   "or estimated from config.json")
    p.add_argument("--gpu", help=f"GPU preset ({', '.join(GPUS)}); default: with --config the "
                   f"GPUs detected, else {DEFAULT_GPU}")
    p.add_argument("--gpu-mem", metavar="SIZE", help="memory per GPU, overriding the preset (96GiB, 80GB)")
    p.add_argument("--mem-fraction", type=float, help="share of GPU memory for weights + KV "
                   f"(SGLang --mem-fraction-static; default {DEFAULT_MEM_FRACTION})")
    p.add_argument("--kv-dtype", help="bf16, fp16 or fp8 (default bf16)")
    p.add_argument("--weight-dtype", help="bf16, fp16, fp8, int8 or int4 (default bf16)")
    p.add_argument("--context", metavar="TOKENS", help="tokens per user: 131072 or 128K (x1024) "
                   f"(default {DEFAULT_CONTEXT} or the model's window when shorter)")
    p.add_argument("--tp", type=arg(count), help="tensor-parallel size (default 1)")
    p.add_argument("--gpus", type=arg(count), help="number of GPUs (default: --tp x dp-size)")
    p.add_argument("--page-size", type=arg(count), metavar="TOKENS",
                   help="tokens per page = per stored block: shows the block's bytes")
    p.add_argument("--hicache-size", type=arg(positive), metavar="GB",
                   help="L2 host KV pool per GPU in GB (SGLang --hicache-size)")
    p.add_argument("--hicache-ratio", type=arg(positive),
                   help="L2 host KV pool / HBM KV pool (SGLang --hicache-ratio; its default 2)")
    p.add_argument("--host-mem", metavar="SIZE",
                   help="host memory the L2 pools of all GPUs share (default: with --config and "
                   "the GPUs detected, MemTotal under --root): refuses pools past it less "
                   "SGLang's 10 GiB reserve")
    p.add_argument("--l2-gbps", type=arg(positive), default=DEFAULT_L2_GBPS,
                   help="host -> GPU bandwidth per GPU, GB/s (default %(default)g: PCIe Gen5 x16)")
    p.add_argument("--think-s", type=float, default=DEFAULT_THINK_S,
                   help="seconds a user thinks between turns, KV parked (default %(default)g)")
    p.add_argument("--turn-s", type=arg(positive), default=DEFAULT_TURN_S,
                   help="seconds a turn keeps its KV in HBM: prefill and reply (default "
                   "%(default)g)")
    p.add_argument("--ttft", type=arg(positive), default=DEFAULT_TTFT_S, metavar="S",
                   help="time to first token a returning user accepts: the reload plus its wait "
                   "for the tier (default %(default)g s)")
    p.add_argument("--tier-capacity", metavar="SIZE", help="NVMe / Redis capacity for the whole "
                   "deployment (e.g. 3.84TB; default: store.capacity with --config); caps the "
                   "conversations carried")
    p.add_argument("--users", type=arg(count), help="target users for sizing the tier "
                   "(default: the conversations carried)")
    p.add_argument("--hit-rate", type=float, default=1.0,
                   help="share of returning users whose KV must be kept (default 1.0)")
    p.add_argument("--prefix-tokens", metavar="TOKENS", help="cached prefix length for load vs prefill "
                   "(default: --context)")
    p.add_argument("--read-gbps", type=arg(positive), default=None,
                   help=f"read bandwidth of one drive, GB/s (default {DEFAULT_READ_GBPS:g}: one "
                   "Gen4 NVMe); the tier reads --drives times that per replica")
    p.add_argument("--drives", type=arg(count), default=None,
                   help="distinct drives the tier reads from (default 1); their bandwidth adds up")
    p.add_argument("--probe-io", type=arg(positive), nargs="?", const=4.0, metavar="S",
                   help="with --config: measure the store's read rate now (S seconds of O_DIRECT "
                   "write then read in each directory, one per device, at once; default 4) and "
                   "use it as the L3's bandwidth")
    p.add_argument("--prefill-tps", type=arg(positive), help="prefill tokens/s per GPU (default: derived "
                   f"from the GPU's dense BF16 FLOPS at {DEFAULT_MFU * 100:.0f}%% utilisation)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--comment", action="store_true",
                     help="print the figures as a deployment file's sizing comment block")


def _detected(args: argparse.Namespace) -> tuple[float | None, int, str, GpuPreset | None, int]:
    """With --config: (the drives' GB/s or None, drives, how, the GPU preset or None, GPUs),
    detected under --root."""
    from offload.config import load_file
    from offload.hw.detect import detect
    from offload.hw.drive_set import read_bandwidth as combined
    from offload.hw.live import Live

    facts = detect(load_file(args.config).offload, root=args.root, live=Live(), env={})
    bw = combined(facts, list(facts.directories))
    gpu = next((p for g in facts.gpus if (p := gpu_from_device_name(g.name)) is not None), None)
    if args.probe_io is not None:
        return (*_measured(args, facts), gpu, len(facts.gpus))
    how = f"offload.store: {bw.text}" if bw.gbps is not None else (
        f"{DEFAULT_READ_GBPS:g} GB/s assumed: offload.store is {bw.text}")
    return bw.gbps, bw.drives, how, gpu, len(facts.gpus)


def _measured(args: argparse.Namespace, facts: Facts) -> tuple[float, int, str]:
    """--probe-io: the read rate of the store's directories measured now (one per device, all
    at once: `offload.hw.probe_io`), as `detect --probe-io` measures it."""
    from offload.hw.drive_set import one_per_device
    from offload.hw.probe_io import probe_io_many

    if not facts.live:
        raise ConfigError([f"--probe-io: {args.root} is a fixture tree, not this machine: "
                           "nothing is measured there (leave out --root)"])
    dirs = [cd.path for cd in one_per_device(list(facts.directories))]
    io = probe_io_many(dirs, seconds=args.probe_io)
    if not io.read_gbps:
        raise RunError(f"--probe-io: no read rate measured: {io.reason}")
    return io.read_gbps, len(dirs), f"measured by --probe-io: {io.reason}"


def _gpu(args: argparse.Namespace, detected: GpuPreset | None) -> GpuPreset:
    if args.gpu is not None:
        gpu = find_gpu(args.gpu)
        if gpu is None:
            raise ConfigError([f"unknown GPU preset '{args.gpu}'; presets: {', '.join(GPUS)} "
                               "(--gpu-mem overrides a preset's memory)"])
        return gpu
    if args.config is None:
        return GPUS["B200-192G"]
    if detected is None:
        raise ConfigError([f"--gpu: no GPU with a preset found under {args.root}; name the "
                           f"deployment's GPU ({', '.join(GPUS)})"])
    return detected


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    dep = Deployment()
    bw, drives, how, found = None, 1, "", None
    if args.probe_io is not None and args.config is None:
        raise ConfigError(["--probe-io: measures the drives of a deployment file: give --config"])
    if args.config is not None:
        from offload.config import load_file

        dep = from_config(load_file(args.config))
        if args.probe_io is not None and (args.read_gbps is not None or args.drives is not None):
            raise ConfigError(["--probe-io measures the bandwidth --read-gbps/--drives give: "
                               "one or the other"])
        if args.read_gbps is None and args.drives is None or args.gpu is None:
            bw, drives, how, found, _ = _detected(args)
    if args.read_gbps is not None or args.drives is not None or bw is None:
        per, drives = args.read_gbps or DEFAULT_READ_GBPS, args.drives or 1
        bw = per * drives
        if drives > 1:
            how = f"{drives} drives x {per:g} GB/s"
        elif args.read_gbps is not None:
            how = ""                   # one drive at the given rate: nothing to add
    gpu = _gpu(args, found)

    def size(flag: str, text: str | None) -> int | None:
        try:
            return None if text is None else int(Size.parse(text))
        except ValueError as e:
            raise ConfigError([f"{flag} '{text}': {e}"]) from e

    def pick(flag_value: Any, file_value: Any, default: Any) -> Any:
        return flag_value if flag_value is not None else (
            file_value if file_value is not None else default)

    params = None if args.params is None else parse_count(args.params, "--params")
    model = pick(args.model, dep.model, DEFAULT_MODEL)
    where = "--model" if args.model is not None or dep.model is None else "sglang.model-path"
    try:
        arch, source = load_architecture(model, params)
    except ConfigError as e:
        raise ConfigError([e.problems[0].replace("--model", where, 1)] + e.problems[1:]) from None
    tp = pick(args.tp, dep.tp, 1)
    if args.context is not None:
        context = parse_tokens(args.context, "--context")
    elif dep.context is not None:
        context = dep.context
        if arch.max_context and context > arch.max_context:
            raise ConfigError([f"sglang.context-length: {context} is past {arch.name}'s "
                               f"{arch.max_context:,}-token context window "
                               "(max_position_embeddings); SGLang refuses it"])
    else:                                         # 128K, or the model's window when shorter
        context = min(parse_tokens(DEFAULT_CONTEXT), arch.max_context or MAX_TOKENS)
    from offload.hw.fsroot import Root
    from offload.launch.checks import MEMINFO, SGLANG_HOST_RESERVE, meminfo

    host_mem, host_source = size("--host-mem", args.host_mem), "--host-mem"
    if host_mem is None and found is not None and args.gpu is None:
        # planning on the deployment's host (its GPUs detected): its memory bounds the L2 pools
        mem = meminfo(Root(args.root))
        host_mem, host_source = (mem[0], f"{MEMINFO} MemTotal") if mem else (None, "")
    l2_size = None if args.hicache_size is None else int(args.hicache_size * 1e9)
    l2_ratio = args.hicache_ratio
    if l2_size is None and l2_ratio is None:      # the file's pair, as SGLang reads it
        l2_size, l2_ratio = dep.l2_size, dep.l2_ratio
    return PlanInputs(
        arch=arch, gpu=gpu, context=context,
        kv_dtype=(parse_dtype(args.kv_dtype, KV_DTYPES, "--kv-dtype") if args.kv_dtype
                  else dep.kv_dtype or "bf16"),
        weight_dtype=(parse_dtype(args.weight_dtype, WEIGHT_DTYPES, "--weight-dtype")
                      if args.weight_dtype else dep.weight_dtype or "bf16"),
        tp=tp, gpus=pick(args.gpus, None, tp * (dep.dp or 1)),
        gpu_mem=size("--gpu-mem", args.gpu_mem),
        mem_fraction=pick(args.mem_fraction, dep.mem_fraction, DEFAULT_MEM_FRACTION),
        tier_capacity=pick(size("--tier-capacity", args.tier_capacity), dep.tier_capacity, None),
        target_users=args.users, hit_rate=args.hit_rate,
        prefix_tokens=(None if args.prefix_tokens is None
                       else parse_tokens(args.prefix_tokens, "--prefix-tokens")),
        read_gbps=bw, prefill_tps=args.prefill_tps, model_source=source, read_drives=drives,
        read_source=how, page_size=pick(args.page_size, dep.page_size, None),
        l2_size=l2_size, l2_ratio=l2_ratio, l2_gbps=args.l2_gbps, think_s=args.think_s,
        turn_s=args.turn_s, ttft_s=args.ttft, host_mem=host_mem, host_reserve=SGLANG_HOST_RESERVE,
        host_mem_source=host_source, tier_name=dep.tier_name)


def run(args: argparse.Namespace) -> int:
    inp = inputs_from_args(args)
    plan = make_plan(inp)
    if args.json:
        print(json.dumps(asdict(plan), indent=2))
    elif args.comment:
        print(format_comment(plan))
    else:
        print(format_table(plan, inp.arch))
    if plan.problems:
        raise RunError("\n".join(f"{inp.arch.name} on {inp.gpus} x {inp.gpu.name} (TP {inp.tp}) "
                                 f"cannot run: {p}" for p in plan.problems))
    return 0
