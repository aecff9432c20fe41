"""What a deployment meets on this machine: the one list of errors and warnings that `detect`
and `launch` print (`config validate`, which runs no detection, checks `check_host` and
`salt_file_errors` of it).

Primitives:
- `Findings(errors, warnings, notes)`: lines naming the key, the value and the fix.
- `salt_file_errors(cfg)`: `store.salt_file` unreadable, not private or empty.
- `machine_findings(cfg, facts, root, cache_dir, connect) -> Findings`: the `offload:` section
  on this machine. Errors: `offload.hw.host_checks.check_host` (NUMA node, cache directory,
  secret files) and `store.salt_file` (read by the one secret-file loader). Warnings: a Redis
  node that does not accept a connection (`connect` given: the live machine), the agent not
  reachable, each configured cache directory's drive problems (`drive_set.choose_drives`: on the
  system's file system, two on one device, another socket, not on NVMe). `detect` prints exactly
  these; `launch` prints them and puts them in its `--json` `warnings`.
- `deployment_findings(values, facts) -> Findings`: the `sglang:` section (SGLang's parse of it)
  on this machine. Errors: a `model-path` that is no directory or file here and no HuggingFace
  id either (`ORG/NAME`: SGLang downloads those); more GPUs than the host shows for `tp-size` ×
  `pp-size` × `dp-size` (`dp-size` not counted with `enable-dp-attention`) ÷ `nnodes` on a GPU
  device; pinned L2 host memory (`hicache-size` GB per rank × ranks on this host) past the
  host's memory less SGLang's 10 GiB reserve (`/proc/meminfo` MemTotal). Warnings: that much
  past what is free now (MemAvailable: SGLang checks it at start and refuses). Both are capped by
  the cgroup's `memory.max` (a container's limit, as SGLang caps them). Under a fixture
  root the model path is not checked (fixtures hold no weights): a note says so.
- `meminfo(root) -> (total, available, source) | None`: bytes, from `/proc/meminfo` under the root,
  capped by `/sys/fs/cgroup/memory.max`.
Reads only under the root; nothing here starts or connects anything but `connect`.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from offload.config import OffloadConfig
from offload.errors import ConfigError
from offload.hw.fsroot import Root

if TYPE_CHECKING:
    from offload.hw.facts import Facts
    from offload.hw.host_checks import Connect

MEMINFO = "/proc/meminfo"
CGROUP_MAX = "/sys/fs/cgroup/memory.max"   # cgroup v2: this container's memory limit, or "max"
# SGLang keeps this much host memory free when it sizes a HiCache pool (pool_host/base.py
# HICACHE_HOST_MEMORY_RESERVE_BYTES, 0.5.23) and sizes hicache-size in GB (1e9 bytes).
SGLANG_HOST_RESERVE = 10 << 30
GB = 1_000_000_000
# A HuggingFace repository id: NAME or ORG/NAME (what SGLang downloads when no such path exists).
_HF_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")
GPU_DEVICES = (None, "cuda")   # SGLang's device unset picks cuda where it sees a GPU


@dataclass(frozen=True)
class Findings:
    errors: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def salt_file_errors(cfg: OffloadConfig) -> list[str]:
    """`store.salt_file` must be a private, readable, non-empty file (live machine only)."""
    if not cfg.store.salt_file:
        return []
    from offload.secret import read_secret_file

    try:
        read_secret_file(cfg.store.salt_file, "offload.store.salt_file", min_bytes=1)
    except ConfigError as e:
        return list(e.problems)
    return []


def machine_findings(cfg: OffloadConfig, facts: "Facts", root: str | Root = "/",
                     cache_dir: str | None = None, connect: "Connect | None" = None
                     ) -> Findings:
    """The `offload:` section against this machine (see the module doc)."""
    from offload.hw.drive_set import choose_drives
    from offload.hw.host_checks import check_host

    r = root if isinstance(root, Root) else Root(root)
    found = check_host(cfg, r, cache_dir, connect=connect if r.live else None)
    errors = list(found.errors) + (salt_file_errors(cfg) if r.live else [])
    warnings = list(found.warnings)
    if facts.agent.reachable is False:
        warnings.append(f"offload.agent.address: {facts.agent.reason}; the dpu path and the "
                        "agent's tier are unavailable until it is (start `sglang-offload agent` "
                        "there or fix the address)")
    warnings += choose_drives(facts, cfg).warnings
    return Findings(tuple(errors), tuple(warnings))


def meminfo(root: Root) -> tuple[int, int, str] | None:
    """(MemTotal, MemAvailable, where the total came from) in bytes from /proc/meminfo under
    `root`, each capped by this cgroup's `memory.max` (a container's limit, which pinned pages
    are charged to); None if /proc/meminfo is unreadable."""
    text = root.read(MEMINFO)
    if not text:
        return None
    fields: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+):\s+([0-9]+)\s*kB$", line.strip())
        if m:
            fields[m.group(1)] = int(m.group(2)) * 1024
    if "MemTotal" not in fields:
        return None
    total, available = fields["MemTotal"], fields.get("MemAvailable", fields["MemTotal"])
    limit = root.read(CGROUP_MAX)
    if limit and limit.isdigit() and int(limit) < total:
        return int(limit), min(available, int(limit)), CGROUP_MAX
    return total, available, f"{MEMINFO} MemTotal"


def ranks_per_host(values: argparse.Namespace) -> tuple[int, str]:
    """(SGLang processes with a GPU and a host pool on this host, how that was counted)."""
    tp = int(getattr(values, "tp_size", 1) or 1)
    pp = int(getattr(values, "pp_size", 1) or 1)
    dp = int(getattr(values, "dp_size", 1) or 1)
    nnodes = int(getattr(values, "nnodes", 1) or 1)
    if getattr(values, "enable_dp_attention", False):
        dp = 1                                   # data-parallel attention inside the TP group
    total = tp * pp * dp
    how = f"tp-size {tp}" + (f" × pp-size {pp}" if pp > 1 else "") + \
        (f" × dp-size {dp}" if dp > 1 else "")
    if nnodes > 1:
        how += f" ÷ nnodes {nnodes}"
    return max(total // nnodes, 1), how


def _model_path(values: argparse.Namespace, root: Root) -> tuple[list[str], list[str]]:
    path = getattr(values, "model_path", None)
    if not path:
        return [], []
    if _HF_ID.fullmatch(path) and not os.path.isabs(path):
        return [], []                        # SGLang downloads it unless such a path exists
    if not root.live:
        return [], [f"sglang.model-path {path}: not checked under a fixture root (it holds no "
                    "weights)"]
    if os.path.exists(os.path.expanduser(path)):
        return [], []
    return [f"sglang.model-path: {path!r} does not exist on this machine, and it is not a "
            "HuggingFace id (ORG/NAME) either; put the weights there (or mount them), or fix "
            "the path"], []


def _gpus(values: argparse.Namespace, facts: "Facts") -> list[str]:
    if getattr(values, "device", None) not in GPU_DEVICES:
        return []
    need, how = ranks_per_host(values)
    have = len(facts.gpus)
    if need <= have:
        return []
    seen = f"{have} GPU{'s' if have != 1 else ''}" + (
        f" ({facts.gpu_probe.reason})" if have == 0 else "")
    return [f"sglang.tp-size: {how} needs {need} GPUs on this host, and it has {seen}; run it "
            f"on a host with {need} GPUs, or lower tp-size (its heads must still split), or "
            "set device: cpu"]


def _l2_memory(values: argparse.Namespace, root: Root) -> tuple[list[str], list[str], list[str]]:
    size = float(getattr(values, "hicache_size", 0) or 0)
    if size <= 0:
        return [], [], []
    ranks, how = ranks_per_host(values)
    want = int(size * GB) * ranks
    mem = meminfo(root)
    what = (f"sglang.hicache-size: {size:g} GB of pinned host memory per rank × {ranks} "
            f"rank{'s' if ranks != 1 else ''} ({how}) = {want / GB:,.0f} GB")
    if mem is None:
        return [], [], [f"{what}: not checked ({MEMINFO} unreadable under the root)"]
    total, available, source = mem
    fit = max(total - SGLANG_HOST_RESERVE, 0) // ranks
    fix = (f"lower hicache-size to at most {fit // GB} GB per rank (an integer, GB of 10^9 "
           "bytes) or size L2 with hicache-ratio" if fit >= GB else
           "run it on a host with more memory") + "; docs/deploy/launch.md#sizing-l2-host-memory"
    if want > total - SGLANG_HOST_RESERVE:
        return [f"{what}, but this host has {total / GB:,.1f} GB ({source}) and SGLang "
                f"keeps 10 GiB of it free: the pools cannot be pinned; {fix}"], [], []
    if want > available - SGLANG_HOST_RESERVE:
        return [], [f"{what}, more than is free now ({available / GB:,.1f} GB MemAvailable, less "
                    "SGLang's 10 GiB reserve): SGLang refuses to start until that much is free"
                    ], []
    return [], [], [f"{what} of {total / GB:,.1f} GB host memory (MemTotal)"]


def deployment_findings(values: argparse.Namespace, facts: "Facts",
                        root: str | Root = "/") -> Findings:
    """The `sglang:` section's parsed values against this machine (see the module doc)."""
    r = root if isinstance(root, Root) else Root(root)
    errors, notes = _model_path(values, r)
    errors += _gpus(values, facts)
    l2_errors, l2_warnings, l2_notes = _l2_memory(values, r)
    return Findings(tuple(errors + l2_errors), tuple(l2_warnings), tuple(notes + l2_notes))
