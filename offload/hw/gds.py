"""GPUDirect Storage facts, and whether the cache directory's file system can use GDS.

Primitives:
- `probe_gds(root, live, env) -> Gds`: the nvidia-fs kernel module (`/sys/module/nvidia_fs`,
  `/proc/driver/nvidia-fs/{version,stats}`, `/dev/nvidia-fs*`), cufile.json (`$CUFILE_ENV_PATH_JSON`
  or `/etc/cufile.json`, read under the root; `//` comments allowed, as NVIDIA ships it), the
  P2PDMA prerequisites, `/run/udev`, and whether `libcufile.so.0` loads (`live.load_cufile`).
- `parse_modules(text)`, `required_drivers(cache, nvme)`, `nvfs_driver_support(gds, cache, nvme)
  -> (ok, why)`: nvidia-fs serves GDS I/O only through the storage drivers registered with it
  (`/proc/driver/nvidia-fs/modules`: `nvme`, `nvme_rdma`, `lnet`, ...); on a cache directory
  whose driver is not listed every cuFile read runs in compat mode with no error (seen with the
  NVMe driver of DOCA-OFED 26.01 and nvidia-fs 2.29.4), so that is not a GDS path. On the live
  machine the file is read with `/dev/nvidia-fs0` held open (`live.nvfs_modules`: registration
  happens on open); under a fixture root the file is read as it is.
- `fs_gds_support(cache) -> (supported, why)`: ext4 (ordered) / xfs on NVMe or NVMe-oF, Lustre,
  WekaFS, GPFS, BeeGFS, NFS over RDMA: real GDS; tmpfs, overlayfs, btrfs, zfs and the rest:
  compat mode only (which is not a GDS path).
- `load_jsonc(text) -> dict`: JSON with `//` and `/* */` comments.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

from offload.hw.facts import CacheDir, Gds, Nvme
from offload.hw.fsroot import Root
from offload.hw.live import NOT_CHECKED, NVFS_MODULES, Live

DISTRIBUTED_FS = {"lustre": "Lustre", "wekafs": "WekaFS", "gpfs": "GPFS", "beegfs": "BeeGFS"}
LOCAL_FS = {"ext4", "xfs"}
# the names nvidia-fs lists for the drivers it registered with [gds-nvidia-fs nvfs-dma.h,
# NVFS_PROC_MOD_*_KEY]; a file system's entry holds the alternatives any one of which will do
FS_DRIVERS = {"lustre": ("lnet", "lustre"), "wekafs": ("wekafsio",), "gpfs": ("mmfslinux",),
              "beegfs": ("beegfs",), "nfs": ("rpcrdma",), "nfs4": ("rpcrdma",)}
NVME_DRIVERS = {"pcie": "nvme", "rdma": "nvme_rdma"}


def load_jsonc(text: str) -> Any:
    """Parse JSON that may hold `//` line and `/* */` block comments (outside strings)."""
    out, i, n, in_str = [], 0, len(text), False
    while i < n:
        c = text[i]
        if in_str:
            out.append(c)
            if c == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
            out.append(c)
        elif text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
            continue
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = n if end < 0 else end + 2
            continue
        else:
            out.append(c)
        i += 1
    cleaned = re.sub(r",(\s*[}\]])", r"\1", "".join(out))  # tolerate trailing commas
    return json.loads(cleaned)


def _bool(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


def probe_gds(root: Root, live: Live, env: Mapping[str, str]) -> Gds:
    notes = []
    version = root.read("/sys/module/nvidia_fs/version")
    source = "/sys/module/nvidia_fs/version"
    if version is None and root.exists("/sys/module/nvidia_fs"):
        version = "?"
    if version is None:
        proc = root.read("/proc/driver/nvidia-fs/version")
        if proc:
            version, source = proc.split(":")[-1].strip() or "?", "/proc/driver/nvidia-fs/version"
    stats = root.read("/proc/driver/nvidia-fs/stats") or ""
    gds_version = peerdirect = None
    for line in stats.splitlines():
        if line.startswith("GDS Version:"):
            gds_version = line.split(":", 1)[1].strip()
        elif line.startswith("Mellanox PeerDirect Supported:"):
            peerdirect = line.split(":", 1)[1].strip().lower() == "true"
    devices = sum(1 for n in root.listdir("/dev") if re.fullmatch(r"nvidia-fs\d+", n))
    notes.append(f"nvidia_fs {version}" if version else "nvidia_fs not loaded")

    cf_path = env.get("CUFILE_ENV_PATH_JSON") or "/etc/cufile.json"
    cf_text = root.read(cf_path)
    props: dict[str, Any] = {}
    cufile = None
    if cf_text is not None:
        cufile = cf_path
        try:
            data = load_jsonc(cf_text)
            props = data.get("properties", {}) if isinstance(data, dict) else {}
            notes.append(f"{cf_path} read")
        except ValueError as e:
            notes.append(f"{cf_path} is not valid JSON: {e}")
    else:
        notes.append(f"no {cf_path} (libcufile defaults)")
    mp = root.read("/sys/module/nvme_core/parameters/multipath")
    multipath = None if mp is None else mp.strip().upper().startswith("Y")
    modules_text = live.nvfs_modules() if live.nvfs_modules else root.read(NVFS_MODULES)
    modules = None if modules_text is None else parse_modules(modules_text)
    if version:
        notes.append(f"{NVFS_MODULES} missing" if modules is None else
                     f"nvidia-fs storage drivers: {', '.join(modules) or 'none'}")
    if live.load_cufile is None:
        libcufile = NOT_CHECKED
    else:
        ok, why = live.load_cufile()
        libcufile = "loads" if ok else "missing"
        notes.append(why)
    return Gds(nvidia_fs=version, gds_version=gds_version, peerdirect=peerdirect, devices=devices,
               cufile_json=cufile, allow_compat_mode=_bool(props.get("allow_compat_mode")),
               force_compat_mode=_bool(props.get("force_compat_mode")),
               use_pci_p2pdma=_bool(props.get("use_pci_p2pdma")), nvme_multipath=multipath,
               libcufile=libcufile, run_udev=root.isdir("/run/udev"), source=source,
               reason="; ".join(notes), modules=modules)


def parse_modules(text: str) -> tuple[str, ...]:
    """Driver names of `/proc/driver/nvidia-fs/modules` (lines `name: version`)."""
    names = (line.split(":", 1)[0].strip() for line in text.splitlines())
    return tuple(dict.fromkeys(n for n in names if n))


def required_drivers(cache: CacheDir, nvme: Sequence[Nvme]) -> list[tuple[str, ...]]:
    """The storage drivers nvidia-fs must list for GDS on `cache`, each as its alternatives:
    a distributed file system's client; on ext4/xfs, the driver of each NVMe controller below
    the block device (md/dm over NVMe included): `nvme` (PCIe) or `nvme_rdma` (NVMe-oF)."""
    fs = (cache.fs_type or "").lower()
    if fs in FS_DRIVERS:
        return [FS_DRIVERS[fs]]
    transport = {n.name: (n.transport or "pcie") for n in nvme}
    names = dict.fromkeys(NVME_DRIVERS.get(transport.get(c, "pcie"), "nvme") for c in cache.nvme)
    if not names and any(re.match(r"^nvme\d+", d) for d in cache.disks):
        names = {"nvme": None}
    return [(n,) for n in names]


def nvfs_driver_support(gds: Gds, cache: CacheDir, nvme: Sequence[Nvme]) -> tuple[bool, str]:
    """Whether nvidia-fs registered the driver(s) under the cache directory (else compat mode)."""
    need = required_drivers(cache, nvme)
    if not need:
        return True, f"cache directory {cache.path}: no storage driver to look up"
    what = " and ".join("/".join(alts) for alts in need) or "its storage driver"
    where = f"cache directory {cache.path}"
    if gds.modules is None:
        return False, (f"nvidia_fs is loaded but {NVFS_MODULES} is missing: cannot tell whether "
                       f"it registered {what} (the driver of {where}); a driver it did not "
                       "register serves every GDS read in compat mode, silently")
    listed = ", ".join(gds.modules) or "nothing"
    missing = [alts for alts in need if not set(alts) & set(gds.modules)]
    if missing:
        names = " and ".join("/".join(alts) for alts in missing)
        return False, (f"nvidia-fs does not list {names}, the driver of {where} ({NVFS_MODULES}"
                       f" lists {listed}): every GDS read there would silently run in compat "
                       "mode")
    return True, f"nvidia-fs lists {what} for {where} ({NVFS_MODULES}: {listed})"


def fs_gds_support(cache: CacheDir) -> tuple[bool, str]:
    """Whether GDS (not compat mode) can run on the cache directory's file system."""
    fs = (cache.fs_type or "").lower()
    opts = cache.mount_options or ""
    where = f"cache directory {cache.path} is on {fs or 'an unknown file system'}"
    if not fs:
        return False, f"{where}: cannot tell the file system ({cache.reason})"
    if fs in DISTRIBUTED_FS:
        return True, f"{where} ({DISTRIBUTED_FS[fs]}, GDS-capable)"
    if fs in ("nfs", "nfs4"):
        if "proto=rdma" in opts:
            return True, f"{where} over RDMA (GDS-capable)"
        return False, f"{where} over TCP: GDS needs NFS over RDMA; compat mode only"
    if fs in LOCAL_FS:
        if fs == "ext4" and "data=journal" in opts:
            return False, f"{where} with data=journal: GDS needs data=ordered; compat mode only"
        if not cache.disks:
            return False, f"{where} but its block device is unknown; compat mode only"
        not_nvme = [d for d in cache.disks if not re.match(r"^nvme\d+", d)]
        if not_nvme:
            return False, (f"{where} on {', '.join(not_nvme)}, not NVMe: GDS needs NVMe or "
                           "NVMe-oF; compat mode only")
        return True, f"{where} on NVMe {', '.join(cache.disks)} (GDS-capable)"
    return False, f"{where}: GDS runs in compat mode only on {fs}"
