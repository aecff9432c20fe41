"""The transfer-path decision: a pure function of the facts and the config.

Primitives:
- `decide(facts, cfg) -> Decision` (role `host`|`agent`, path `dpu`|`gds`|`cpu`, reasons, every
  rejected path with the failed check and its fix, whether blocks move from GPU memory, and the
  NUMA node for CPU staging). `cfg.transfer.path` `auto` walks the table (first match wins):
  DPU Arm -> agent; DPU path if every DPU check passes; GDS if every GDS check passes; else CPU
  staging, saying why. An explicit `gds` or `dpu` that cannot work raises `PathRejectedError`
  (a `offload.errors.PathUnavailableError`) naming the failed check: never a silent fallback.
  So does a `redis.url` whose Python side (redis-py) is missing.
- `gds_checks(facts)`, `dpu_checks(facts, cfg)`: the ordered checks (`Check`: name, ok, detail,
  fix). `ok=None` means a live probe was not checked (fixture root) and is assumed to pass. The
  last check of each is `python`: the path's Python side in the interpreter that runs SGLang
  (`facts.python`, pyside.py), so a path whose library is missing is rejected with its fix.
- `python_check(facts, path)`: that check alone (also `redis` when `redis.url` is set).
The gds and cpu paths' reasons end with the store: its directories and the combined read
bandwidth of their distinct devices (drive_set.read_bandwidth: "4 drives (...), ~31.5 GB/s
combined"), also in `Decision.read_gbps` and `.bandwidth` (launch's worth-it line names it;
empty on the dpu path, whose blocks go to the agent's store). The GDS
`cache_fs` and `nvfs_modules` checks hold for every directory of `offload.store.paths`
(`nvfs_modules`: nvidia-fs registered the driver under each, else GDS runs in compat mode).
No I/O here: everything comes from `Facts` (see detect.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from offload.config import OffloadConfig
from offload.errors import PathUnavailableError
from offload.hw.drive_set import Bandwidth, read_bandwidth
from offload.hw.facts import Facts, NetCard, cache_numa_node, gpu_numa_node
from offload.hw.gds import fs_gds_support, nvfs_driver_support
from offload.hw.live import NOT_CHECKED
from offload.hw.pci import DPU_CAPABLE_NET_IDS, level_rank

PREFERENCE = ("dpu", "gds", "cpu")


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool | None  # None: not checked (fixture root), assumed to pass
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class Rejection:
    path: str
    check: str
    fix: str


@dataclass(frozen=True)
class Decision:
    role: str  # host | agent
    path: str  # dpu | gds | cpu
    requested: str  # transfer.path in the config
    reasons: tuple[str, ...]
    rejected: tuple[Rejection, ...]
    gpu_direct: bool  # blocks move from GPU memory with no host bounce
    numa_node: int | None  # where CPU staging buffers and I/O threads belong
    read_gbps: float | None = None  # the store's combined read bandwidth (distinct devices)
    bandwidth: str = ""  # how: "4 drives (...), ~31.5 GB/s combined (...)"


class PathRejectedError(PathUnavailableError):
    """An explicit `transfer.path` cannot work; `.path`, `.check` name why, `.fix` how."""

    def __init__(self, path: str, check: Check):
        self.path, self.check, self.fix = path, f"{check.name}: {check.detail}", check.fix
        what = ("offload.redis.url is set but the Redis tier" if path == "redis" else
                f"offload.transfer.path is {path!r} but it")
        super().__init__(f"{what} cannot work here: {self.check} (fix: {check.fix})")


def first_failure(checks: list[Check]) -> Check | None:
    return next((c for c in checks if c.ok is False), None)


def _gpu_check(facts: Facts) -> Check:
    if not facts.gpus:
        return Check("gpu", False, "no NVIDIA GPU found (NVML and sysfs): nothing to move from GPU "
                     "memory", "run on a host with an NVIDIA GPU and its driver")
    if facts.gpu_probe.nvml == "unavailable":
        return Check("gpu", False, f"{len(facts.gpus)} GPU(s) in sysfs but NVML is unavailable "
                     f"({facts.gpu_probe.reason})", "install and load the NVIDIA driver")
    return Check("gpu", True if facts.gpu_probe.nvml == "ok" else None,
                 f"{len(facts.gpus)} NVIDIA GPU(s) ({facts.gpus[0].name})")


def python_check(facts: Facts, path: str) -> Check:
    side = facts.python
    if side is None:
        return Check("python", None, f"the Python side of {path} was {NOT_CHECKED}")
    p = next(x for x in side.paths if x.path == path)
    return Check("python", p.present, p.detail, p.fix)


def _kernel_at_least(release: str | None, major: int, minor: int) -> bool:
    try:
        parts = (release or "").split("-")[0].split(".")
        return (int(parts[0]), int(parts[1])) >= (major, minor)
    except (ValueError, IndexError):
        return False


def gds_checks(facts: Facts) -> list[Check]:
    g, kernel = facts.gds, facts.platform.kernel
    checks = [_gpu_check(facts)]
    if g.nvidia_fs:
        checks.append(Check("nvidia_fs", True, f"nvidia_fs {g.nvidia_fs} loaded ({g.source})"))
    elif g.use_pci_p2pdma and _kernel_at_least(kernel, 6, 2) and g.nvme_multipath is False:
        checks.append(Check("nvidia_fs", True, f"kernel P2PDMA route: kernel {kernel}, "
                            "use_pci_p2pdma in cufile.json, nvme_core multipath off"))
    else:
        checks.append(Check("nvidia_fs", False, "nvidia_fs kernel module not loaded (no "
                            "/sys/module/nvidia_fs/version) and no kernel P2PDMA route",
                            "install the GDS package (nvidia-gds) and `modprobe nvidia_fs`"))
    if g.libcufile == "missing":
        checks.append(Check("libcufile", False, "libcufile.so.0 does not load",
                            "install the cuFile library (libcufile, part of nvidia-gds / CUDA)"))
    else:
        checks.append(Check("libcufile", True if g.libcufile == "loads" else None,
                            f"libcufile.so.0 {g.libcufile}"))
    checks.append(Check("run_udev", g.run_udev, "/run/udev is a directory" if g.run_udev else
                        "/run/udev is not a directory (cuFile needs udev to map NVMe devices)",
                        "run with /run/udev present (in a container: mount /run/udev)"))
    wsl = kernel is not None and ("microsoft" in kernel.lower() or "wsl" in kernel.lower())
    checks.append(Check("wsl", False if wsl else (True if kernel else None),
                        f"kernel {kernel or NOT_KNOWN}" + (" is WSL (no GDS)" if wsl else
                                                           " is not WSL"),
                        "run on a native Linux kernel"))
    if g.force_compat_mode:
        checks.append(Check("cufile_json", False, f"{g.cufile_json}: properties.force_compat_mode "
                            "is true (compat mode only)", "set force_compat_mode to false"))
    else:
        checks.append(Check("cufile_json", True, f"{g.cufile_json or 'no cufile.json'}: compat "
                            "mode not forced"))
    verdicts = [fs_gds_support(cd) for cd in facts.directories]
    ok, why = next((v for v in verdicts if not v[0]), verdicts[0])
    if ok and len(verdicts) > 1:
        why += f" (and the other {len(verdicts) - 1} directories of offload.store.paths)"
    checks.append(Check("cache_fs", ok, why, "" if ok else "put every cache directory "
                        "(offload.store.path or paths) on ext4/xfs on local NVMe (or a "
                        "GDS-capable file system)"))
    if g.nvidia_fs:     # the P2PDMA route has no nvidia-fs driver registrations
        drivers = [nvfs_driver_support(g, cd, facts.nvme) for cd in facts.directories]
        ok, why = next((v for v in drivers if not v[0]), drivers[0])
        checks.append(Check("nvfs_modules", ok, why, "" if ok else
                            "use a storage driver that registers with nvidia-fs (the "
                            "distribution's nvme module, or a DOCA-OFED/MLNX_OFED nvme built "
                            "with GDS support), then reload nvidia_fs and check that `cat "
                            "/proc/driver/nvidia-fs/modules` lists it (with a cuFile process "
                            "running); until then the cpu path serves"))
    checks.append(python_check(facts, "gds"))
    return checks


NOT_KNOWN = "unknown"


def _dpu_cards(facts: Facts) -> list[NetCard]:
    return [c for c in facts.nics if c.kind == "bluefield"
            and int(c.device_id, 16) in DPU_CAPABLE_NET_IDS]


def _active_port(facts: Facts, card: NetCard) -> str | None:
    for r in facts.rdma:
        if r.name in card.rdma_devices:
            for p in r.ports:
                if p.state == "ACTIVE":
                    return f"{r.name} port {p.port} ACTIVE ({p.link_layer}, {p.rate})"
    return None


def dpu_checks(facts: Facts, cfg: OffloadConfig) -> tuple[list[Check], list[NetCard]]:
    """Ordered DPU checks, and the cards that pass the hardware checks."""
    cards = _dpu_cards(facts)
    if not cards:
        other = [c for c in facts.nics if c.kind == "bluefield"]
        detail = (f"{other[0].model} {other[0].bdf} cannot serve the DPU path" if other else
                  "no BlueField DPU found (PCI 0x15b3 a2d6/a2d9/a2dc/a2df)")
        return [Check("bluefield", False, detail, "install a BlueField-2 or newer DPU")], []
    checks = [Check("bluefield", True, ", ".join(f"{c.model} {c.bdf}" for c in cards) + " found")]
    in_dpu = [c for c in cards if c.mode == "dpu"]
    if not in_dpu:
        c = cards[0]
        if c.mode == "nic":
            fix = (f"switch it to DPU mode (mlxconfig -d {c.bdf} s INTERNAL_CPU_OFFLOAD_ENGINE=0 "
                   "and power-cycle), or set offload.hw.dpu_mode: dpu if the evidence is wrong")
        else:
            fix = ("run the host rshim service (so /dev/rshim*/misc shows BF_MODE) or install "
                   "mlxconfig; or set offload.hw.dpu_mode: dpu")
        src = f" from {c.mode_source}" if c.mode_source else ""
        evidence = f" ({c.mode_evidence}{src})" if c.mode_evidence else ""
        checks.append(Check("dpu_mode", False, f"{c.model} {c.bdf} is in {c.mode} mode{evidence}",
                            fix))
        return checks, []
    checks.append(Check("dpu_mode", True, "; ".join(
        f"{c.model} {c.bdf} in DPU mode ({c.mode_evidence} from {c.mode_source})"
        for c in in_dpu)))
    d = facts.doca
    checks.append(Check("doca", d.present, d.reason,
                        "install DOCA on the host (doca-host / doca-all) from NVIDIA"))
    ports = [(c, _active_port(facts, c)) for c in in_dpu]
    up = [c for c, p in ports if p]
    if up:
        checks.append(Check("rdma_port", True, "; ".join(p for _, p in ports if p)))
    else:
        names = ", ".join(n for c in in_dpu for n in c.rdma_devices) or "no RDMA device"
        checks.append(Check("rdma_port", False, f"no ACTIVE RDMA port on the DPU ({names})",
                            "connect the port and bring the link up (check `ibstat`, "
                            "`ip link`); load mlx5_ib"))
    if cfg.agent.address is None:
        checks.append(Check("agent_address", False, "offload.agent.address is not set",
                            "run `sglang-offload agent` on the DPU and set offload.agent.address: "
                            "HOST:PORT"))
    else:
        checks.append(Check("agent_address", True, f"offload.agent.address {cfg.agent.address}"))
        a = facts.agent
        checks.append(Check("agent_reachable", a.reachable, a.reason,
                            f"start `sglang-offload agent` on the DPU and check that "
                            f"{cfg.agent.address} is reachable"))
    checks.append(_gpu_check(facts))
    checks.append(python_check(facts, "dpu"))
    return checks, up


def _gpu_direct_dpu(facts: Facts, cards: list[NetCard]) -> tuple[bool, str]:
    gdr = facts.gpudirect_rdma
    if not gdr.available:
        return False, f"staged through pinned host memory: {gdr.reason}"
    targets = {c.functions[0] if c.functions else c.bdf for c in cards}
    worst: list[str] = []
    for g in facts.gpus:
        levels = [d.level for d in facts.distances if d.gpu_index == g.index
                  and d.target in targets]
        best = min(levels, key=level_rank, default="unknown")
        if level_rank(best) > level_rank("PXB"):
            worst.append(f"GPU{g.index} to the DPU is {best}")
    if worst:
        return False, ("staged through pinned host memory: " + ", ".join(worst) +
                       " (GPUDirect RDMA only within PXB, as NCCL)")
    return True, f"from GPU memory: {gdr.provider} and every GPU within PXB of the DPU"


def _numa(facts: Facts, cfg: OffloadConfig) -> int | None:
    if cfg.transfer.numa_node is not None:
        return cfg.transfer.numa_node
    n = gpu_numa_node(facts, 0)
    return n if n is not None else cache_numa_node(facts)


def _store(facts: Facts) -> tuple[str, Bandwidth]:
    """(reason: the cache directories and the combined read bandwidth of their distinct devices,
    that bandwidth)."""
    dirs = facts.directories
    what = dirs[0].path if len(dirs) == 1 else f"{len(dirs)} directories"
    bw = read_bandwidth(facts, list(dirs))
    where = f"on {bw.text}" if bw.drives else f"({bw.text})"
    return f"store: {what} {where}", bw


def _assumed(checks: list[Check]) -> list[str]:
    return [f"assumed: {c.name} passes ({c.detail}"
            + (")" if NOT_CHECKED in c.detail else f"; {NOT_CHECKED} on a fixture root)")
            for c in checks if c.ok is None]


def decide(facts: Facts, cfg: OffloadConfig) -> Decision:
    requested = cfg.transfer.path
    numa = _numa(facts, cfg)
    if facts.platform.on_dpu_arm:
        arm = Check("platform", False, facts.platform.reason,
                    "run `sglang-offload agent` here and inference on the host")
        if requested in ("gds", "dpu"):
            raise PathRejectedError(requested, arm)
        rej = tuple(Rejection(p, "platform: this process runs on a BlueField DPU's Arm cores",
                              arm.fix) for p in ("dpu", "gds"))
        return Decision("agent", "cpu", requested, (
            facts.platform.reason, "role agent: serve inference hosts; blocks reach this DPU's "
            "NVMe through its own CPU (O_DIRECT)"), rej, False, numa)
    redis_reasons: list[str] = []
    if cfg.redis.url is not None:
        rc = python_check(facts, "redis")
        if rc.ok is False:
            raise PathRejectedError("redis", Check("python", False, rc.detail, rc.fix))
        redis_reasons.append(f"redis tier: {rc.detail}")
    gchecks = gds_checks(facts)
    dchecks, cards = dpu_checks(facts, cfg)
    failed = {"dpu": first_failure(dchecks), "gds": first_failure(gchecks), "cpu": None}
    path: str
    if requested in ("gds", "dpu"):
        bad = failed[requested]
        if bad is not None:
            raise PathRejectedError(requested, bad)
        path = requested
    elif requested == "cpu":
        path = "cpu"
    else:
        path = next(p for p in PREFERENCE if failed[p] is None)
    reasons: list[str] = [f"transfer.path {requested}" + (": chosen by detection" if
                                                          requested == "auto" else "")]
    gpu_direct = False
    if path == "dpu":
        gpu_direct, how = _gpu_direct_dpu(facts, cards)
        reasons += [f"dpu: {c.detail}" for c in dchecks if c.ok]
        reasons += [f"dpu {how}"] + _assumed(dchecks)
    elif path == "gds":
        gpu_direct = True
        reasons += [f"gds: {c.detail}" for c in gchecks if c.ok] + _assumed(gchecks)
    else:
        where = ", ".join(dict.fromkeys(
            (cd.fs_type or "the cache file system") + (f" ({cd.block_device})"
                                                       if cd.block_device else "")
            for cd in facts.directories))
        reasons.append(f"cpu staging: pinned host buffers + O_DIRECT I/O on {where}"
                       + (f", NUMA node {numa}" if numa is not None else ""))
        if not facts.gpus:
            reasons.append("no NVIDIA GPU: nothing to move from GPU memory")
    bw = Bandwidth(None, 0, "")
    if path != "dpu":            # on the dpu path blocks go to the agent's store, not these
        store, bw = _store(facts)
        reasons.append(store)
    reasons += redis_reasons
    rejected = []
    for p in PREFERENCE:
        if p == path:
            continue
        bad = failed[p]
        if bad is not None:
            rejected.append(Rejection(p, f"{bad.name}: {bad.detail}", bad.fix))
        elif requested != "auto":
            rejected.append(Rejection(p, f"transfer.path: the config asks for {requested}",
                                      f"set offload.transfer.path: auto (or {p})"))
        else:
            rejected.append(Rejection(p, f"preference: {path} ranks above {p} when both work",
                                      f"set offload.transfer.path: {p} to force it"))
    return Decision("host", path, requested, tuple(reasons), tuple(rejected), gpu_direct, numa,
                    bw.gbps, bw.text)
