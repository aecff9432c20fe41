"""Which drives the cache should use, how the configured directories sit on them, and their
combined read bandwidth: a pure function of the facts and the config.

Primitives:
- `choose_drives(facts, cfg) -> DriveSet`. Each `Drive` (drives.py) is used or skipped, first
  rule that matches: nothing mounted from it; it holds a system file system (`/`, `/boot`,
  `/usr`, `/var`, `/home`, ...); it shares a disk with one; every mount of it is read-only; its
  file system is not ext4 or xfs (ext4 with data=journal neither: no O_DIRECT); it is on another
  NUMA node than the server's GPUs (`server_gpu_nodes`); else it is used, with the directory
  `<mount point>/sglang-offload`. Then every configured directory (`offload.store.paths`, or
  `path`, or `--cache-dir`) is judged: the drive it is on, and a warning when two share a device
  (they share its bandwidth), when one is on a system file system, on another socket, on a drive
  skipped for another reason, or not on NVMe at all. With a single directory and more usable
  drives, `suggestion` is the `paths:` list of the usable ones.
- `server_gpu_nodes(facts, cfg) -> (nodes, why)`: `offload.transfer.numa_node`, else the NUMA
  nodes of the GPUs the server uses (those `CUDA_VISIBLE_DEVICES` names by index, else all).
- `read_bandwidth(facts, dirs) -> Bandwidth` (GB/s or None, drives, text): the sum over the
  distinct devices under
  `dirs` (directories sharing a disk count once) of their NVMe controllers' PCIe link rates
  (7 GB/s, one Gen4 drive, assumed where a link is unknown): "4 drives (...), ~31.5 GB/s combined".
- `one_per_device(dirs)`: the first directory on each distinct device (what `--probe-io` measures).
No I/O here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from offload.config import OffloadConfig
from offload.hw.facts import CacheDir, Drive, Facts

SYSTEM_MOUNTS = ("/", "/boot", "/boot/efi", "/efi", "/usr", "/var", "/home")
CACHE_FS = ("ext4", "xfs")
DIR_NAME = "sglang-offload"
ASSUMED_DRIVE_GBPS = 7.0   # one PCIe Gen4 NVMe drive, sequential read (plan's default)


@dataclass(frozen=True)
class Bandwidth:
    gbps: float | None  # None: no directory is on NVMe
    drives: int  # distinct NVMe drives counted
    text: str


@dataclass(frozen=True)
class DriveUse:
    device: str
    use: bool
    directory: str | None  # the cache directory it would hold (a used drive only)
    reason: str


@dataclass(frozen=True)
class DirectoryCheck:
    key: str  # offload.store.paths[1], offload.store.path or --cache-dir
    path: str
    device: str | None  # the drive it is on; None: not on an NVMe drive
    reason: str
    warnings: tuple[str, ...]


@dataclass(frozen=True)
class DriveSet:
    gpu_nodes: tuple[int, ...]
    gpu_nodes_reason: str
    drives: tuple[DriveUse, ...]
    directories: tuple[DirectoryCheck, ...]
    read_gbps: float | None  # combined over the configured directories' distinct devices
    bandwidth: str
    suggestion: tuple[str, ...]  # a paths: list; () when there is nothing to suggest
    suggestion_reason: str

    @property
    def chosen(self) -> tuple[DriveUse, ...]:
        return tuple(d for d in self.drives if d.use)

    @property
    def warnings(self) -> tuple[str, ...]:
        return tuple(w for d in self.directories for w in d.warnings)


def _nodes(nodes: tuple[int, ...]) -> str:
    return f"node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))}"


def server_gpu_nodes(facts: Facts, cfg: OffloadConfig) -> tuple[tuple[int, ...], str]:
    if cfg.transfer.numa_node is not None:
        return (cfg.transfer.numa_node,), f"offload.transfer.numa_node {cfg.transfer.numa_node}"
    gpus, how = list(facts.gpus), "every GPU"
    cvd = (facts.cuda_visible_devices or "").strip()
    if cvd:
        items = [x.strip() for x in cvd.split(",") if x.strip()]
        if all(x.isdigit() for x in items):
            gpus = [g for g in gpus if g.index in {int(x) for x in items}]
            how = f"CUDA_VISIBLE_DEVICES={cvd}"
        else:
            how = f"every GPU (CUDA_VISIBLE_DEVICES={cvd} is not a list of indices)"
    if not gpus:
        return (), "no GPU known: drives on every NUMA node count"
    nodes = tuple(sorted({g.numa_node for g in gpus if g.numa_node is not None}))
    names = ",".join(str(g.index) for g in gpus)
    if not nodes:
        return (), f"GPU {names} ({how}): NUMA node unknown, drives on every node count"
    return nodes, f"GPU {names} ({how}) on NUMA {_nodes(nodes)}"


def _system(d: Drive) -> str | None:
    for p in d.mount_points:
        if p in SYSTEM_MOUNTS or p.startswith("/boot/"):
            return "the root file system (/)" if p == "/" else p
    return None


def _judge(d: Drive, system: dict[str, str], nodes: tuple[int, ...], where: str) -> DriveUse:
    def skip(why: str) -> DriveUse:
        return DriveUse(d.device, False, None, why)

    if not d.mount_points:
        return skip(d.reason.split("; ")[0] + f" (make one: mkfs.xfs /dev/{d.device}, and "
                    "mount it)")
    held = _system(d)
    if held:
        return skip(f"holds {held}")
    shared = [f"{disk} with {system[disk]}" for disk in d.disks if disk in system]
    if shared:
        return skip(f"shares {', '.join(shared)}")
    if d.read_only:
        return skip(f"mounted read-only at {', '.join(d.mount_points)}")
    fs = (d.fs_type or "").lower()
    if fs not in CACHE_FS:
        return skip(f"{d.fs_type} at {d.mount_points[0]}: the cache wants ext4 or xfs (O_DIRECT, "
                    "GDS)")
    if fs == "ext4" and "data=journal" in (d.mount_options or ""):
        return skip(f"ext4 with data=journal at {d.mount_points[0]}: no O_DIRECT (mount it "
                    "data=ordered)")
    numa = f", NUMA {_nodes(d.numa_nodes)}" if d.numa_nodes else ", NUMA node unknown"
    if nodes and d.numa_nodes and not set(d.numa_nodes) <= set(nodes):
        return skip(f"on NUMA {_nodes(d.numa_nodes)}, another socket than the server's GPUs "
                    f"({where}): its reads would cross the socket link")
    directory = os.path.join(d.mount_points[0], DIR_NAME)
    return DriveUse(d.device, True, directory, f"{d.fs_type} at {d.mount_points[0]}{numa}, on "
                    f"{', '.join(d.nvme)}")


def _groups(dirs: list[CacheDir]) -> list[list[int]]:
    """Indexes of `dirs` grouped by device: one group per set of directories sharing a disk, in
    the order of their first directory."""
    groups: list[tuple[set[str], list[int]]] = []
    for i, cd in enumerate(dirs):
        keys = set(cd.disks) or {f"dev:{cd.device or cd.mount_source or cd.path}"}
        hit = [g for g in groups if g[0] & keys]
        merged = (set(keys), [i])
        for g in hit:
            merged[0].update(g[0])
            merged[1][:0] = g[1]
            groups.remove(g)
        groups.append(merged)
    return sorted(sorted(g[1]) for g in groups)


def one_per_device(dirs: list[CacheDir]) -> list[CacheDir]:
    """The first directory on each distinct device (directories sharing a disk are one)."""
    return [dirs[g[0]] for g in _groups(dirs)]


def read_bandwidth(facts: Facts, dirs: list[CacheDir]) -> Bandwidth:
    """Combined read bandwidth of the distinct devices under `dirs`, and how it was found."""
    rate = {n.name: n.link_gbps for n in facts.nvme}
    total, assumed, devices, ctrls_all, other = 0.0, 0, [], [], 0
    for g in _groups(dirs):
        cds = [dirs[i] for i in g]
        ctrls = list(dict.fromkeys(c for cd in cds for c in cd.nvme))
        if not ctrls:
            other += 1
            continue
        dev = cds[0].block_device or cds[0].path
        disks = tuple(dict.fromkeys(d for cd in cds for d in cd.disks))
        part = len(disks) == 1 and dev.startswith(disks[0])
        devices.append(dev if part or disks in ((), (dev,)) else f"{dev} over {', '.join(disks)}")
        for c in ctrls:
            ctrls_all.append(c)
            r = rate.get(c)
            total += r if r is not None else ASSUMED_DRIVE_GBPS
            assumed += r is None
    n = len(ctrls_all)
    if not n:
        return Bandwidth(None, 0, "not on NVMe: no drive figure")
    basis = ("sum of their PCIe link ceilings" if n > 1 else "its PCIe link ceiling")
    if assumed:
        basis = f"{ASSUMED_DRIVE_GBPS:g} GB/s assumed for {assumed} drive(s) whose PCIe link is unknown"
    text = (f"{n} drive{'s' if n > 1 else ''} ({', '.join(devices)}), ~{total:.3g} GB/s"
            f"{' combined' if n > 1 else ''} ({basis}"
            + ("; directories sharing a device count once" if len(dirs) > len(devices) + other
               else "")
            + (f"; {other} directory(ies) not on NVMe not counted" if other else "") + ")")
    return Bandwidth(total, n, text)


def _keys(facts: Facts, cfg: OffloadConfig) -> list[str]:
    dirs = [os.path.normpath(cd.path) for cd in facts.directories]
    configured = [os.path.normpath(p) for p in cfg.store.directories()]
    if dirs == configured:
        return ([f"offload.store.paths[{i}]" for i in range(len(dirs))] if cfg.store.paths
                else ["offload.store.path"])
    return ["--cache-dir"] * len(dirs)


def _check_dirs(facts: Facts, cfg: OffloadConfig, uses: dict[str, DriveUse]
                ) -> list[DirectoryCheck]:
    by_dev = {d.dev: d for d in facts.drives if d.dev}
    dirs = list(zip(_keys(facts, cfg), facts.directories))
    out = []
    for key, cd in dirs:
        drive = by_dev.get(cd.device or "")
        warns = []
        if drive is None:
            where = f"{cd.fs_type or 'unknown file system'} at {cd.mount_point or '?'}"
            reason = f"not on an NVMe drive ({where})"
            if cd.mount_point in SYSTEM_MOUNTS:
                warns.append(f"{key} {cd.path} is on the system's {cd.mount_point} file system "
                             f"({where}), not a drive of its own")
            elif cd.fs_type is not None:
                warns.append(f"{key} {cd.path} is not on an NVMe drive ({where})")
        else:
            u = uses[drive.device]
            reason = f"on {drive.device} ({drive.reason.split('; ')[0]})"
            if not u.use:
                warns.append(f"{key} {cd.path} is on {drive.device} ({u.reason}): give the "
                             "cache drives the Drives table marks `yes`")
        out.append(DirectoryCheck(key, cd.path, drive.device if drive else None, reason,
                                  tuple(warns)))
    for g in _groups([cd for _, cd in dirs]):
        if len(g) > 1:
            named = [f"{dirs[i][0]} {dirs[i][1].path}" for i in g]
            names = ", ".join(named[:-1]) + " and " + named[-1]
            dev = dirs[g[0]][1].block_device or dirs[g[0]][1].mount_point
            first = out[g[0]]
            out[g[0]] = DirectoryCheck(first.key, first.path, first.device, first.reason,
                                       first.warnings + (
                f"{names} are on one device ({dev}): they share its bandwidth and count once; "
                "give each directory a drive of its own",))
    return out


def choose_drives(facts: Facts, cfg: OffloadConfig) -> DriveSet:
    nodes, where = server_gpu_nodes(facts, cfg)
    system = {disk: _system(d) or "" for d in facts.drives if _system(d) for disk in d.disks}
    uses = {d.device: _judge(d, system, nodes, where) for d in facts.drives}
    dirs = _check_dirs(facts, cfg, uses)
    bw = read_bandwidth(facts, list(facts.directories))
    chosen = [u for u in uses.values() if u.use]
    on = {d.device for d in dirs if d.device}
    suggestion: tuple[str, ...] = ()
    why = ""
    if len(dirs) == 1 and chosen and (len(chosen) > 1 or chosen[0].device not in on):
        suggestion = tuple(u.directory for u in chosen if u.directory)
        by = {d.device: d for d in facts.drives}
        picked = [CacheDir(path=u.directory or "", exists=None, mount_point=None, fs_type=None,
                           mount_source=None, mount_options=None, device=by[u.device].dev,
                           block_device=u.device, disks=by[u.device].disks,
                           nvme=by[u.device].nvme, free_bytes=None, source="", reason="")
                  for u in chosen]
        why = f"now {bw.text}; with the usable drives {read_bandwidth(facts, picked).text}"
    return DriveSet(nodes, where, tuple(uses.values()), tuple(dirs), bw.gbps, bw.text, suggestion,
                    why)
