"""GPUDirect Storage facts, and whether the cache directory's file system can use GDS.

Primitives:
- `probe_gds(root, live, env) -> Gds`: the nvidia-fs kernel module (`/sys/module/nvidia_fs`,
  `/proc/driver/nvidia-fs/{version,stats}`, `/dev/nvidia-fs*`), cufile.json (`$CUFILE_ENV_PATH_JSON`
  or `/etc/cufile.json`, read under the root; `//` comments allowed, as NVIDIA ships it), the
  P2PDMA prerequisites, `/run/udev`, and whether `libcufile.so.0` loads (`live.load_cufile`).
- `fs_gds_support(cache) -> (supported, why)`: ext4 (ordered) / xfs on NVMe or NVMe-oF, Lustre,
  WekaFS, GPFS, BeeGFS, NFS over RDMA: real GDS; tmpfs, overlayfs, btrfs, zfs and the rest:
  compat mode only (which is not a GDS path).
- `load_jsonc(text) -> dict`: JSON with `//` and `/* */` comments.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from offload.hw.facts import CacheDir, Gds
from offload.hw.fsroot import Root
from offload.hw.live import NOT_CHECKED, Live

DISTRIBUTED_FS = {"lustre": "Lustre", "wekafs": "WekaFS", "gpfs": "GPFS", "beegfs": "BeeGFS"}
LOCAL_FS = {"ext4", "xfs"}


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
               reason="; ".join(notes))


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
