"""The facts detection found: plain frozen records, each with its `source` and a `reason`.

Primitives: one dataclass per kind of fact (`Platform`, `Gpu`, `NetCard`, `RdmaDevice`, `Doca`,
`GpuDirectRdma`, `Gds`, `Nvme`, `CacheDir`, `Drive`, `Distance`, `AgentFact`, `IoProbe`) gathered in
`Facts` (`PythonSide`: what the interpreter that runs SGLang can import, per path);
`facts_to_json(facts)` gives the plain data of `detect --json` (schema in schema.json).
`source` names where a fact was read (a machine path, `nvml`, `mlxconfig`, `config`, or
`not checked` for a live probe that did not run); `reason` says what it means in words.
Helpers for the CPU path: `gpu_numa_node(facts, index)` and `cache_numa_node(facts)`;
`Facts.directories`: every cache directory probed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Platform:
    on_dpu_arm: bool
    evidence: tuple[str, ...]
    kernel: str | None
    arch: str | None
    source: str
    reason: str


@dataclass(frozen=True)
class GpuProbe:
    """How GPUs were looked for: NVML status (`ok`, `unavailable`, `not checked`) and sysfs."""

    nvml: str
    driver: str | None
    source: str
    reason: str


@dataclass(frozen=True)
class Gpu:
    index: int
    bdf: str
    name: str
    device_id: str | None
    memory_bytes: int | None
    numa_node: int | None
    mig: bool | None
    source: str
    reason: str


@dataclass(frozen=True)
class NetCard:
    """One network card (PCI function .0 of its slot): ConnectX, BlueField, or another NIC.

    For a BlueField, `mode` is `dpu`, `nic` or `unknown`, with the evidence it came from."""

    bdf: str
    vendor: str
    device_id: str
    kind: str  # bluefield | connectx | other
    model: str
    generation: str | None
    functions: tuple[str, ...]
    rshim: str | None
    mode: str | None
    mode_source: str | None
    mode_evidence: str | None
    rdma_devices: tuple[str, ...]
    netdevs: tuple[str, ...]
    numa_node: int | None
    source: str
    reason: str


@dataclass(frozen=True)
class RdmaPort:
    port: int
    state: str
    phys_state: str
    link_layer: str
    rate: str


@dataclass(frozen=True)
class RdmaDevice:
    name: str
    bdf: str | None
    fw_ver: str | None
    hca_type: str | None
    board_id: str | None
    ports: tuple[RdmaPort, ...]
    source: str
    reason: str


@dataclass(frozen=True)
class Doca:
    present: bool
    version: str | None
    source: str
    reason: str


@dataclass(frozen=True)
class GpuDirectRdma:
    available: bool
    provider: str | None
    source: str
    reason: str


@dataclass(frozen=True)
class Gds:
    """Raw GPUDirect Storage facts; whether GDS works here is judged in select.gds_checks."""

    nvidia_fs: str | None  # module version, None = not loaded
    gds_version: str | None
    peerdirect: bool | None
    devices: int
    cufile_json: str | None  # machine path of the config used
    allow_compat_mode: bool | None
    force_compat_mode: bool | None
    use_pci_p2pdma: bool | None
    nvme_multipath: bool | None
    libcufile: str  # loads | missing | not checked
    run_udev: bool
    source: str
    reason: str
    # storage drivers registered with nvidia-fs (/proc/driver/nvidia-fs/modules: nvme,
    # nvme_rdma, lnet, ...); None: that file is missing. A driver not listed there serves GDS
    # reads in compat mode, silently.
    modules: tuple[str, ...] | None = None


@dataclass(frozen=True)
class NvmeNamespace:
    name: str
    size_bytes: int | None
    logical_block_size: int | None
    rotational: bool | None


@dataclass(frozen=True)
class Nvme:
    name: str
    model: str | None
    serial: str | None
    firmware: str | None
    transport: str | None
    address: str | None
    state: str | None
    bdf: str | None
    numa_node: int | None
    namespaces: tuple[NvmeNamespace, ...]
    source: str
    reason: str
    link: str | None = None  # PCIe link of its function: "Gen4 x4" (current_link_speed/width)
    link_gbps: float | None = None  # that link's payload rate, GB/s: a ceiling on its reads


@dataclass(frozen=True)
class CacheDir:
    path: str
    exists: bool | None
    mount_point: str | None
    fs_type: str | None
    mount_source: str | None
    mount_options: str | None
    device: str | None  # major:minor
    block_device: str | None
    disks: tuple[str, ...]
    nvme: tuple[str, ...]
    free_bytes: int | None
    source: str
    reason: str


@dataclass(frozen=True)
class Drive:
    """One block device on NVMe that holds (or could hold) the cache: a namespace, a partition,
    or md/dm above namespaces, with the file systems mounted from it; or a namespace that has
    nothing mounted from it (`mount_points` empty). Free space on the live machine only."""

    device: str  # block device name: nvme3n1, nvme0n1p2, md0
    dev: str | None  # major:minor
    disks: tuple[str, ...]  # NVMe namespaces below it
    nvme: tuple[str, ...]  # their controllers
    numa_nodes: tuple[int, ...]  # of those controllers (empty: unknown)
    size_bytes: int | None
    fs_type: str | None
    mount_points: tuple[str, ...]  # writable mounts first
    mount_options: str | None
    read_only: bool  # every mount of it is read-only
    free_bytes: int | None
    source: str
    reason: str


@dataclass(frozen=True)
class Distance:
    gpu: str
    gpu_index: int
    target: str
    target_kind: str  # nic | dpu | nvme
    target_name: str
    level: str  # PIX | PXB | PHB | NODE | SYS | unknown
    source: str
    reason: str


@dataclass(frozen=True)
class AgentFact:
    address: str | None
    reachable: bool | None  # None = not checked
    source: str
    reason: str


@dataclass(frozen=True)
class IoProbe:
    path: str
    bytes: int
    write_gbps: float | None
    read_gbps: float | None
    o_direct: bool
    source: str
    reason: str


@dataclass(frozen=True)
class PathPython:
    """Whether one path's Python side is there (see pyside.py); present None = not checked."""

    path: str  # gds | dpu | redis | metrics
    present: bool | None
    detail: str
    fix: str


@dataclass(frozen=True)
class PythonSide:
    executable: str
    status: str  # ok | unavailable | not checked
    python: str | None
    torch: str | None  # torch's version
    torch_cuda: str | None  # torch.version.cuda; None: no torch or a CPU build
    modules: dict[str, str | None]  # import name -> "dist version" (None: not importable)
    paths: tuple[PathPython, ...]
    source: str
    reason: str


@dataclass(frozen=True)
class Facts:
    root: str
    live: bool
    platform: Platform
    gpu_probe: GpuProbe
    gpus: tuple[Gpu, ...]
    nics: tuple[NetCard, ...]
    rdma: tuple[RdmaDevice, ...]
    doca: Doca
    gpudirect_rdma: GpuDirectRdma
    gds: Gds
    nvme: tuple[Nvme, ...]
    cache_dir: CacheDir
    distances: tuple[Distance, ...]
    agent: AgentFact
    io: IoProbe | None = None
    python: PythonSide | None = None
    drives: tuple[Drive, ...] = ()
    cache_dirs: tuple[CacheDir, ...] = ()  # every configured directory (cache_dir is the first)
    cuda_visible_devices: str | None = None  # the server's GPUs, from the environment

    @property
    def directories(self) -> tuple[CacheDir, ...]:
        """Every cache directory probed (`cache_dirs`, or the one `cache_dir`)."""
        return self.cache_dirs or (self.cache_dir,)


def facts_to_json(facts: Facts) -> dict[str, Any]:
    return dataclasses.asdict(facts)


def gpu_numa_node(facts: Facts, index: int = 0) -> int | None:
    """NUMA node of GPU `index` (None if unknown or no such GPU)."""
    for g in facts.gpus:
        if g.index == index:
            return g.numa_node
    return None


def cache_numa_node(facts: Facts) -> int | None:
    """NUMA node of the (first) NVMe controller holding the cache directory, if known."""
    by_name = {n.name: n for n in facts.nvme}
    for name in facts.cache_dir.nvme:
        if name in by_name and by_name[name].numa_node is not None:
            return by_name[name].numa_node
    return None


def distance(facts: Facts, gpu_index: int, target: str) -> str:
    """PCIe distance level between a GPU and a device BDF (or NVMe name); `unknown` if absent."""
    for d in facts.distances:
        if d.gpu_index == gpu_index and target in (d.target, d.target_name):
            return d.level
    return "unknown"
