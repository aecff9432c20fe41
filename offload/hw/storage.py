"""NVMe controllers and namespaces; the cache directory's mount, file system and device.

Primitives:
- `parse_mountinfo(text) -> list[Mount]` (`/proc/self/mountinfo`; fs type after ` - `).
- `probe_cache_dir(root, path, live) -> CacheDir`: on the live machine the mount is found from
  `os.stat(path).st_dev` (of the nearest existing ancestor); under a fixture root by the longest
  mount-point prefix of the path in the root's `proc/self/mountinfo`. Then `/sys/dev/block/M:m`
  gives the block device, its whole disk, the disks below md/dm (`slaves/`) and their NVMe
  controllers. Free space (`os.statvfs`) only on the live machine.
- `probe_nvme(root, pci) -> tuple[Nvme, ...]`: `/sys/class/nvme/nvmeX` (model, serial, firmware,
  transport, address, state, PCI function, NUMA node, PCIe link from the function's
  `current_link_speed`/`current_link_width`) and its namespaces.
- `pcie_link(speed, width) -> (label, GB/s)`: "16.0 GT/s PCIe" x 4 -> ("Gen4 x4", 7.88), the
  link's payload rate after line coding: a ceiling on what a drive behind it reads.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from offload.hw.facts import CacheDir, Nvme, NvmeNamespace
from offload.hw.fsroot import Root
from offload.hw.live import NOT_CHECKED
from offload.hw.pci import PciDevice

MOUNTINFO = "/proc/self/mountinfo"
NAMESPACE = re.compile(r"^nvme\d+(c\d+)?n\d+$")


@dataclass(frozen=True)
class Mount:
    mount_point: str
    device: str  # major:minor
    fs_type: str
    source: str
    options: str  # per-mount options, then super options


def _unescape(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def parse_mountinfo(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        if " - " not in line:
            continue
        left, right = line.split(" - ", 1)
        lf, rf = left.split(), right.split()
        if len(lf) < 6 or len(rf) < 2:
            continue
        mounts.append(Mount(mount_point=_unescape(lf[4]), device=lf[2], fs_type=rf[0],
                            source=_unescape(rf[1]),
                            options=lf[5] + ("," + rf[2] if len(rf) > 2 else "")))
    return mounts


def _under(path: str, mount_point: str) -> bool:
    return (mount_point == "/" or path == mount_point
            or path.startswith(mount_point.rstrip("/") + "/"))


def find_mount(mounts: list[Mount], path: str, device: str | None = None) -> Mount | None:
    """The mount holding `path`: longest mount-point prefix (among mounts of `device` if given);
    the last such line wins, as later mounts cover earlier ones."""
    best: Mount | None = None
    for m in mounts:
        if device is not None and m.device != device:
            continue
        if _under(path, m.mount_point) and (best is None
                                            or len(m.mount_point) >= len(best.mount_point)):
            best = m
    if best is None and device is not None:
        return find_mount(mounts, path)
    return best


def _existing(root: Root, path: str) -> tuple[str, str]:
    """(nearest existing ancestor as a real machine path, remainder)."""
    head, rest = os.path.normpath(path), ""
    while head != "/" and not root.exists(head):
        head, tail = os.path.split(head)
        rest = os.path.join(tail, rest) if rest else tail
    real = root.realpath(head) or head
    return real, rest


def disks_below(root: Root, dev: str, depth: int = 0) -> tuple[str | None, list[str]]:
    """(block device name, whole disks below it) for a major:minor."""
    real = root.realpath(f"/sys/dev/block/{dev}")
    if not real:
        return None, []
    name = real.rsplit("/", 1)[-1]
    disk_dir = real.rsplit("/", 1)[0] if root.exists(f"{real}/partition") else real
    slaves = root.listdir(f"{disk_dir}/slaves")
    if slaves and depth < 8:
        disks: list[str] = []
        for s in slaves:
            sdev = root.read(f"/sys/class/block/{s}/dev")
            if sdev:
                disks.extend(disks_below(root, sdev, depth + 1)[1])
        return name, disks
    return name, [disk_dir.rsplit("/", 1)[-1]]


def controller_of(root: Root, disk: str) -> str | None:
    real = root.realpath(f"/sys/class/block/{disk}") or ""
    m = re.search(r"/nvme/(nvme\d+)/", real)
    if m:
        return m.group(1)
    m = re.match(r"^nvme(\d+)(c\d+)?n\d+$", disk)
    return f"nvme{m.group(1)}" if m else None


def probe_cache_dir(root: Root, path: str) -> CacheDir:
    path = os.path.normpath(path if path.startswith("/") else os.path.abspath(path))
    text = root.read(MOUNTINFO)
    exists = root.isdir(path)
    if text is None:
        return CacheDir(path=path, exists=exists, mount_point=None, fs_type=None, mount_source=None,
                        mount_options=None, device=None, block_device=None, disks=(), nvme=(),
                        free_bytes=None, source=MOUNTINFO,
                        reason=f"{MOUNTINFO} is missing under root {root.path}")
    mounts = parse_mountinfo(text)
    real, rest = _existing(root, path)
    device = None
    free = None
    if root.live:
        try:
            st = os.stat(real)
            device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
            vfs = os.statvfs(real)
            free = vfs.f_bavail * vfs.f_frsize
        except OSError:
            pass
    full = os.path.normpath(os.path.join(real, rest)) if rest else real
    m = find_mount(mounts, full, device)
    if m is None:
        return CacheDir(path=path, exists=exists, mount_point=None, fs_type=None, mount_source=None,
                        mount_options=None, device=device, block_device=None, disks=(), nvme=(),
                        free_bytes=free, source=MOUNTINFO, reason="no mount holds this path")
    block, disks = disks_below(root, m.device) if not m.device.startswith("0:") else (None, [])
    nvme = tuple(dict.fromkeys(c for c in (controller_of(root, d) for d in disks) if c))
    how = "os.stat st_dev + " if root.live else "longest prefix in "
    where = f"{m.fs_type} on {m.source} mounted at {m.mount_point}"
    if block:
        where += f", block device {block}" + (f" (disks {', '.join(disks)})" if disks else "")
    if not exists and root.exists(path):
        where += "; it exists and is not a directory (the cache needs a directory)"
    elif not exists:
        where += f"; the directory does not exist yet (nearest: {real})"
    return CacheDir(path=path, exists=exists, mount_point=m.mount_point, fs_type=m.fs_type,
                    mount_source=m.source, mount_options=m.options, device=m.device,
                    block_device=block, disks=tuple(disks), nvme=nvme, free_bytes=free,
                    source=f"{how}{MOUNTINFO}"
                    + ("" if root.live else f" (free space {NOT_CHECKED})"),
                    reason=where)


_GEN = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}


def pcie_link(speed: str | None, width: int | None) -> tuple[str | None, float | None]:
    """(`Gen4 x4`, payload GB/s) of a link from sysfs `current_link_speed` and `_width`."""
    m = re.match(r"^\s*([0-9.]+)\s*GT/s", speed or "")
    if not m or not width or width <= 0:
        return None, None
    gts = float(m.group(1))
    # 8b/10b up to Gen2, 128b/130b for Gen3-5, FLIT (242 of 256 bytes) from Gen6
    per_lane = gts * (0.8 if gts < 8 else 128 / 130 if gts < 64 else 242 / 256) / 8
    gen = _GEN.get(gts)
    return (f"Gen{gen} x{width}" if gen else f"{gts:g} GT/s x{width}"), round(per_lane * width, 2)


def probe_nvme(root: Root, pci: dict[str, PciDevice]) -> tuple[Nvme, ...]:
    out = []
    for name in root.listdir("/sys/class/nvme"):
        if not re.fullmatch(r"nvme\d+", name):
            continue
        base = f"/sys/class/nvme/{name}"
        dev_real = root.realpath(f"{base}/device")
        bdf = dev_real.rsplit("/", 1)[-1] if dev_real else None
        d = pci.get(bdf or "")
        if d is None:
            bdf = None
        numa = d.numa_node if d else root.read_int(f"{base}/numa_node")
        if numa is not None and numa < 0:
            numa = None
        namespaces = []
        for ns in root.listdir(base):
            if not NAMESPACE.match(ns):
                continue
            sectors = root.read_int(f"{base}/{ns}/size")
            rot = root.read_int(f"{base}/{ns}/queue/rotational")
            namespaces.append(NvmeNamespace(
                name=re.sub(r"c\d+n", "n", ns),
                size_bytes=sectors * 512 if sectors is not None else None,
                logical_block_size=root.read_int(f"{base}/{ns}/queue/logical_block_size"),
                rotational=None if rot is None else bool(rot)))
        transport = root.read(f"{base}/transport")
        link, link_gbps = pcie_link(root.read(f"{base}/device/current_link_speed"),
                                    root.read_int(f"{base}/device/current_link_width"))
        out.append(Nvme(name=name, model=root.read(f"{base}/model"),
                        serial=root.read(f"{base}/serial"),
                        firmware=root.read(f"{base}/firmware_rev"), transport=transport,
                        address=root.read(f"{base}/address"), state=root.read(f"{base}/state"),
                        bdf=bdf, numa_node=numa, namespaces=tuple(namespaces), source=base,
                        reason=f"NVMe controller over {transport or 'unknown transport'}, "
                               f"{len(namespaces)} namespace(s)"
                               + (f", PCIe {link} (~{link_gbps:g} GB/s)" if link else ""),
                        link=link, link_gbps=link_gbps))
    return tuple(out)
