"""What works on the device SGLang is given: the flags and environment launch adds, and why.

`choose(values, set_by_user, prefetch) -> DeviceChoice` is a pure function of SGLang's parse of
the `sglang:` section (and the extra flags) and the prefetch wait (`offload.launch.prefetch`): a
key the user set is never overridden, only named.

On `device: cpu` (SGLang 0.5.23, a plain x86 or Arm box, no sgl-kernel CPU build):
- `SGLANG_USE_CPU_ENGINE=1`: SGLang takes its CPU code paths only with it when torch is a CUDA
  build (srt/utils/common.py `is_cpu`); harmless with a CPU build of torch.
- `--attention-backend torch_native`: SGLang's x86 default, intel_amx, needs sgl-kernel's CPU
  ops, which no registry ships. With patches/0008 its extend attends only the new tokens' queries
  (upstream recomputes the whole prompt's attention even when the prefix is cached), so a cache
  hit costs the uncached tail.
- `--cuda-graph-backend-{decode,prefill} disabled`: there is no CUDA.
- `--hicache-io-backend kernel` with the `page_first` layout: the distribution's pure-torch
  host<->device copies (patches/) serve both io backends on CPU; kernel keeps page_first, whose
  page of every layer is one contiguous store block.
On every device, the prefetch wait (`offload.launch.prefetch`): policy `timeout` (SGLang's
default; launch picked `wait_complete` on cpu before, which waits for ever on a stalled tier)
with `prefetch_timeout_base` 0 and `prefetch_timeout_per_ki_token` such that a prefetch waits
no longer than recomputing its tokens would take, capped (`offload.worth_it.max_prefetch_wait_s`)
at the context length; those two go into the storage backend's extra config (`extra_config`).
Measured on CPU (docs/benchmarks.md, 2026-12-02, the demo model): recomputing a cached 8K / 16K
prefix took 12 / 55 s, reading its KV from the raw disk 21 / 54 ms and the whole L3 hit 1.2 /
2.6 s, so a working tier loads everything well inside such a deadline.
On a GPU (or device unset: SGLang picks cuda where it sees one) SGLang's own defaults stand,
but for the prefetch wait.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from offload.launch.prefetch import PrefetchChoice

CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}


@dataclass(frozen=True)
class DeviceChoice:
    device: str                                        # what SGLang runs on: cpu, cuda, ...
    argv: list[str] = field(default_factory=list)      # flags launch adds (before the extras)
    env: dict[str, str] = field(default_factory=dict)  # set in SGLang's environment
    reasons: list[str] = field(default_factory=list)   # one line per choice, and why
    extra_config: dict[str, float] = field(default_factory=dict)   # storage extra-config keys


def _pick(values: argparse.Namespace, user: set[str], dest: str, value: str, why: str,
          argv: list[str], reasons: list[str]) -> None:
    flag = "--" + dest.replace("_", "-")
    if dest in user:
        reasons.append(f"{flag} {getattr(values, dest)}: set in the config (launch would pick "
                       f"{value}: {why})")
        return
    argv += [flag, value]
    reasons.append(f"{flag} {value}: {why}")


def choose(values: argparse.Namespace, set_by_user: set[str],
           prefetch: PrefetchChoice) -> DeviceChoice:
    """The flags and environment for `values.device` (SGLang's parsed arguments), with the
    prefetch wait `prefetch` (`offload.launch.prefetch.decide`) on every device."""
    device = getattr(values, "device", None)
    if device != "cpu":
        where = device or "auto (SGLang picks cuda where it sees a GPU)"
        return DeviceChoice(device or "auto", list(prefetch.argv), {}, [
            f"device {where}: SGLang's own attention backend, CUDA graphs and kernel io backend",
            prefetch.reason], dict(prefetch.extra))
    argv: list[str] = []
    reasons = ["SGLANG_USE_CPU_ENGINE=1: SGLang takes its CPU code paths only with it when torch is "
               "a CUDA build"]
    _pick(values, set_by_user, "attention_backend", "torch_native",
          "SGLang's x86 CPU default (intel_amx) needs sgl-kernel's CPU build, which no registry "
          "ships; with patches/0008 a cached prefix costs no attention, only the new tokens' "
          "queries are attended", argv, reasons)
    for phase in ("decode", "prefill"):
        _pick(values, set_by_user, f"cuda_graph_backend_{phase}", "disabled",
              "no CUDA on device cpu", argv, reasons)
    _pick(values, set_by_user, "hicache_io_backend", "kernel",
          "pure-torch host<->device copies on CPU (patches/), page_first kept: one page of every "
          "layer is one store block", argv, reasons)
    reasons.append(prefetch.reason)
    return DeviceChoice("cpu", argv + prefetch.argv, dict(CPU_ENV), reasons,
                        dict(prefetch.extra))
