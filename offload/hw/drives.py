"""The NVMe drives of the machine and the file systems mounted from them.

Primitive: `probe_drives(root, nvme) -> tuple[Drive, ...]`. Every mount of a block device in
`/proc/self/mountinfo` is followed to its device (`/sys/dev/block/M:m`), its whole disks (through
`slaves/` for md/dm) and their NVMe controllers (storage.py); a device whose disks are all NVMe
namespaces is one `Drive`, with every mount point of it (bind mounts too), its file system, its
size (`size` in 512-byte sectors), whether every mount is read-only, and the NUMA nodes of its
controllers. A namespace nothing is mounted from is a `Drive` too (no mount points), saying what
holds it: swap (`/proc/swaps`), or an md or dm device that is not mounted (`holders/`). Free
space (`os.statvfs`) only on the live machine. Which drives the cache should use is decided in
drive_set.py.
"""

from __future__ import annotations

import os

from offload.hw.facts import Drive, Nvme
from offload.hw.fsroot import Root
from offload.hw.live import NOT_CHECKED
from offload.hw.storage import MOUNTINFO, NAMESPACE, Mount, controller_of, disks_below, parse_mountinfo

SWAPS = "/proc/swaps"


def _size(n: int | None) -> str:
    return "size unknown" if n is None else f"{n / (1 << 40):.1f} TiB" if n >= 1 << 40 else \
        f"{n / (1 << 30):.1f} GiB"


def _read_only(m: Mount) -> bool:
    return "ro" in m.options.split(",")


def _free(root: Root, mount_point: str) -> int | None:
    if not root.live:
        return None
    try:
        vfs = os.statvfs(mount_point)
    except OSError:
        return None
    return vfs.f_bavail * vfs.f_frsize


def _numa(nvme: dict[str, Nvme], ctrls: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(sorted({n for c in ctrls if c in nvme
                         for n in [nvme[c].numa_node] if n is not None}))


def _mounted(root: Root, dev: str, mounts: list[Mount], nvme: dict[str, Nvme]) -> Drive | None:
    block, disks = disks_below(root, dev)
    if not block or not disks or not all(NAMESPACE.match(d) for d in disks):
        return None
    ctrls = tuple(dict.fromkeys(c for c in (controller_of(root, d) for d in disks) if c))
    rw = [m for m in mounts if not _read_only(m)]
    ordered = rw + [m for m in mounts if _read_only(m)]
    points = tuple(dict.fromkeys(m.mount_point for m in ordered))
    first = ordered[0]
    real = root.realpath(f"/sys/dev/block/{dev}")
    sectors = root.read_int(f"{real}/size") if real else None
    size = sectors * 512 if sectors is not None else None
    numa = _numa(nvme, ctrls)
    below = f" over {', '.join(disks)}" if block not in disks else ""
    reason = (f"{first.fs_type} mounted at {', '.join(points)}"
              + (" (read-only)" if not rw else "") + f"; {block}{below}, {_size(size)}, on "
              + ", ".join(ctrls) + (f" (NUMA node {', '.join(map(str, numa))})" if numa else ""))
    return Drive(device=block, dev=dev, disks=tuple(disks), nvme=ctrls, numa_nodes=numa,
                 size_bytes=size, fs_type=first.fs_type, mount_points=points,
                 mount_options=first.options, read_only=not rw,
                 free_bytes=_free(root, points[0]), source=f"{MOUNTINFO}, /sys/dev/block/{dev}"
                 + ("" if root.live else f" (free space {NOT_CHECKED})"), reason=reason)


def _swaps(root: Root) -> set[str]:
    """Block devices in use as swap (`/proc/swaps`: `/dev/nvme0n1p2 partition ...`)."""
    lines = (root.read(SWAPS) or "").splitlines()[1:]
    return {ln.split()[0].rsplit("/", 1)[-1] for ln in lines if ln.split()}


def _unmounted(root: Root, n: Nvme, ns: str, size: int | None, swaps: set[str]) -> Drive:
    holders = root.listdir(f"/sys/class/block/{ns}/holders")
    parts = [p for p in root.listdir(f"/sys/class/block/{ns}") if p.startswith(ns + "p")]
    swap = [d for d in [ns, *parts] if d in swaps]
    if swap:
        why = f"used as swap ({', '.join(swap)})"
    elif holders:
        why = f"part of {', '.join(holders)}, which is not mounted"
    elif parts:
        why = f"no file system mounted from it or its partitions ({', '.join(parts)})"
    else:
        why = "no file system mounted from it"
    numa = (n.numa_node,) if n.numa_node is not None else ()
    return Drive(device=ns, dev=root.read(f"/sys/class/block/{ns}/dev"), disks=(ns,),
                 nvme=(n.name,), numa_nodes=numa, size_bytes=size, fs_type=None, mount_points=(),
                 mount_options=None, read_only=False, free_bytes=None,
                 source=f"{MOUNTINFO}, /sys/class/block/{ns}",
                 reason=f"{why}; {ns}, {_size(size)}, on {n.name}"
                 + (f" (NUMA node {n.numa_node})" if n.numa_node is not None else ""))


def probe_drives(root: Root, nvme: tuple[Nvme, ...]) -> tuple[Drive, ...]:
    by_name = {n.name: n for n in nvme}
    by_dev: dict[str, list[Mount]] = {}
    for m in parse_mountinfo(root.read(MOUNTINFO) or ""):
        if not m.device.startswith("0:"):
            by_dev.setdefault(m.device, []).append(m)
    drives = [d for dev, ms in by_dev.items() if (d := _mounted(root, dev, ms, by_name))]
    used, swaps = {disk for d in drives for disk in d.disks}, _swaps(root)
    for n in nvme:
        for ns in n.namespaces:
            if ns.name not in used and root.exists(f"/sys/class/block/{ns.name}"):
                drives.append(_unmounted(root, n, ns.name, ns.size_bytes, swaps))
    return tuple(drives)
