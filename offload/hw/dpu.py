"""Network cards and BlueField DPUs seen from the host; DOCA; whether we run on a DPU's Arm.

Primitives:
- `probe_cards(root, pci, rdma, dpu_mode, live) -> tuple[NetCard, ...]`: one card per PCI slot
  with a network function (the card is function .0); BlueField generation from the device id,
  its network functions and rshim function; the mode (DPU vs NIC) with the evidence, strongest
  first: the operator override (`hw.dpu_mode`), `/dev/rshim<N>/misc` (`BF_MODE`), `mlxconfig -e q
  INTERNAL_CPU_OFFLOAD_ENGINE` (through `live.run`). No evidence means mode `unknown`.
- `probe_platform(root, pci, live) -> Platform`: the DPU-Arm markers (SoC bridge at 0000:00:00.0,
  /etc/mlnx-release, /usr/bin/bfver, MLNXBF01/MLNXBF04 ACPI devices, DMI product name).
- `probe_doca(root, live) -> Doca`: /opt/mellanox/doca version file, else pkg-config.
- `parse_rshim_misc(text)`, `parse_mlxconfig(text, key)`: parsers, tested on their own.
"""

from __future__ import annotations

import re

from offload.hw.facts import Doca, NetCard, Platform, RdmaDevice
from offload.hw.fsroot import Root
from offload.hw.live import NOT_CHECKED, Live
from offload.hw.pci import BLUEFIELD_IDS, CONNECTX_IDS, PCI_DEVICES, VENDOR_MELLANOX, PciDevice

MLX_KEY = "INTERNAL_CPU_OFFLOAD_ENGINE"
OTHER_NICS = {(0x1AF4, 0x1000): "virtio-net (legacy)", (0x1AF4, 0x1041): "virtio-net",
              (0x8086, 0x1592): "Intel E810-C", (0x14E4, 0x1750): "Broadcom BCM57508"}


def parse_rshim_misc(text: str) -> dict[str, str]:
    """`KEY   value (comment)` lines -> {KEY: value}."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[0].isupper():
            out[parts[0]] = parts[1].strip()
    return out


def parse_mlxconfig(text: str, key: str = MLX_KEY) -> str | None:
    """The current value (`ENABLED(0)`, `DISABLED(1)`) of `key` in `mlxconfig -e q` output."""
    for line in text.splitlines():
        tokens = line.replace("*", " ").split()
        if key in tokens:
            values = tokens[tokens.index(key) + 1:]
            if len(values) >= 3:  # Default, Current, Next Boot
                return values[1]
            if values:
                return values[0]
    return None


def _rshim_modes(root: Root) -> list[tuple[str, dict[str, str]]]:
    found = []
    for name in root.listdir("/dev"):
        if re.fullmatch(r"rshim\d+", name):
            path = f"/dev/{name}/misc"
            text = root.read(path)
            if text is not None:
                found.append((path, parse_rshim_misc(text)))
    return found


def _mode_from_rshim(card_bdfs: set[str], slot: str, rshims: list[tuple[str, dict[str, str]]],
                     single: bool) -> tuple[str, str, str] | None:
    for path, fields in rshims:
        dev = fields.get("DEV_NAME", "")
        matches = dev.startswith("pcie-") and (dev[5:] in card_bdfs or dev[5:].startswith(slot))
        if not matches and not (single and len(rshims) == 1 and not dev.startswith("pcie-")):
            continue
        mode = fields.get("BF_MODE", "").lower()
        if mode.startswith("dpu"):
            return "dpu", path, f"BF_MODE {fields['BF_MODE']}"
        if mode.startswith("nic"):
            return "nic", path, f"BF_MODE {fields['BF_MODE']}"
        if "BF_MODE" in fields:
            return "unknown", path, f"BF_MODE {fields['BF_MODE']}"
    return None  # no rshim for this card, or one without BF_MODE (BlueField-2 and older)


def _mode_from_mlxconfig(bdf: str, live: Live) -> tuple[str, str, str] | None:
    if live.run is None:
        return None
    res = live.run(["mlxconfig", "-d", bdf, "-e", "q", MLX_KEY], 20.0)
    if res is None or res.rc != 0:
        return None
    value = parse_mlxconfig(res.stdout)
    if value is None:
        return None
    if value.startswith("ENABLED") or value.endswith("(0)"):
        return "dpu", "mlxconfig", f"{MLX_KEY} {value}"
    if value.startswith("DISABLED") or value.endswith("(1)"):
        return "nic", "mlxconfig", f"{MLX_KEY} {value}"
    return None


def _card(root: Root, devs: list[PciDevice], rdma: tuple[RdmaDevice, ...], dpu_mode: str,
          rshims: list[tuple[str, dict[str, str]]], n_bluefields: int, live: Live) -> NetCard:
    devs = sorted(devs, key=lambda d: d.bdf)
    first = devs[0]
    net = [d for d in devs if d.is_network or BLUEFIELD_IDS.get(d.device, ("", ""))[1] == "net"]
    head = net[0] if net else first
    bf = [BLUEFIELD_IDS[d.device] for d in devs
          if d.vendor == VENDOR_MELLANOX and d.device in BLUEFIELD_IDS]
    rshim = next((d.bdf for d in devs if d.vendor == VENDOR_MELLANOX
                  and BLUEFIELD_IDS.get(d.device, ("", ""))[1] == "rshim"), None)
    bdfs = {d.bdf for d in devs}
    rdma_names = tuple(r.name for r in rdma if r.bdf in bdfs)
    netdevs = tuple(n for d in net for n in root.listdir(f"{PCI_DEVICES}/{d.bdf}/net"))
    mode = mode_source = mode_evidence = None
    if bf:
        generation = bf[0][0]
        kind, model = "bluefield", generation
        detected = _mode_from_rshim(bdfs, first.slot, rshims, n_bluefields == 1)
        if detected is None or detected[0] == "unknown":
            detected = _mode_from_mlxconfig(head.bdf, live) or detected
        if dpu_mode != "auto":
            mode, mode_source = dpu_mode, "config"
            mode_evidence = (f"hw.dpu_mode: {dpu_mode} (operator override; detected: "
                             f"{detected[0] + ' from ' + detected[1] if detected else 'nothing'})")
        elif detected:
            mode, mode_source, mode_evidence = detected
        else:
            mode, mode_source = "unknown", None
            tried = "no BF_MODE in /dev/rshim*/misc for this card; mlxconfig " + (
                NOT_CHECKED if live.run is None else "gave no answer")
            mode_evidence = tried
        reason = f"{generation} ({'+'.join(sorted({r for _, r in bf}))} functions), mode {mode}"
    else:
        generation = None
        if head.vendor == VENDOR_MELLANOX:
            kind, model = "connectx", CONNECTX_IDS.get(head.device, f"Mellanox 0x{head.device:04x}")
        else:
            kind = "other"
            model = OTHER_NICS.get((head.vendor, head.device),
                                   f"0x{head.vendor:04x}:0x{head.device:04x}")
        reason = f"{model} network controller"
    return NetCard(bdf=first.bdf, vendor=f"0x{head.vendor:04x}", device_id=f"0x{head.device:04x}",
                   kind=kind, model=model, generation=generation,
                   functions=tuple(d.bdf for d in net), rshim=rshim, mode=mode,
                   mode_source=mode_source, mode_evidence=mode_evidence, rdma_devices=rdma_names,
                   netdevs=netdevs, numa_node=head.numa_node,
                   source=f"{PCI_DEVICES}/{first.bdf}", reason=reason)


def probe_cards(root: Root, pci: dict[str, PciDevice], rdma: tuple[RdmaDevice, ...],
                dpu_mode: str, live: Live) -> tuple[NetCard, ...]:
    slots: dict[str, list[PciDevice]] = {}
    for d in pci.values():
        slots.setdefault(d.slot, []).append(d)
    wanted = []
    for devs in slots.values():
        has_net = any(d.is_network for d in devs)
        has_bf = any(d.vendor == VENDOR_MELLANOX and BLUEFIELD_IDS.get(d.device, ("", ""))[1]
                     in ("net", "rshim") for d in devs)
        if has_net or has_bf:
            wanted.append(devs)
    n_bf = sum(1 for devs in wanted if any(d.vendor == VENDOR_MELLANOX and d.device in
                                           BLUEFIELD_IDS for d in devs))
    rshims = _rshim_modes(root)
    cards = [_card(root, devs, rdma, dpu_mode, rshims, n_bf, live) for devs in wanted]
    return tuple(sorted(cards, key=lambda c: c.bdf))


def probe_platform(root: Root, pci: dict[str, PciDevice], live: Live) -> Platform:
    evidence = []
    host_bridge = pci.get("0000:00:00.0")
    if host_bridge and host_bridge.vendor == VENDOR_MELLANOX:
        evidence.append(f"{PCI_DEVICES}/0000:00:00.0 is a Mellanox SoC bridge "
                        f"(0x{host_bridge.device:04x})")
    release = root.read("/etc/mlnx-release")
    if release is not None:
        evidence.append(f"/etc/mlnx-release: {release.splitlines()[0] if release else ''}".strip())
    if root.exists("/usr/bin/bfver"):
        evidence.append("/usr/bin/bfver exists")
    for acpi in root.listdir("/sys/bus/acpi/devices"):
        if acpi.startswith(("MLNXBF01:", "MLNXBF04:")):
            evidence.append(f"/sys/bus/acpi/devices/{acpi} (BlueField "
                            f"{'tmfifo' if acpi.startswith('MLNXBF01') else 'bootctl'})")
    product = root.read("/sys/class/dmi/id/product_name")
    if product and "bluefield" in product.lower():
        evidence.append(f"/sys/class/dmi/id/product_name: {product} (weak evidence)")
    kernel: str | None
    arch: str | None
    if live.uname is not None:
        kernel, arch = live.uname()
        ksource = "uname"
    else:
        kernel, arch = root.read("/proc/sys/kernel/osrelease"), None
        ksource = "/proc/sys/kernel/osrelease" if kernel else NOT_CHECKED
    on_arm = bool(evidence)
    reason = ("this process runs on a BlueField DPU's Arm cores: " + "; ".join(evidence)
              if on_arm else "inference host: no BlueField SoC marker found")
    source = evidence[0].split(" ", 1)[0].rstrip(":") if on_arm else f"{PCI_DEVICES}/0000:00:00.0"
    return Platform(on_dpu_arm=on_arm, evidence=tuple(evidence), kernel=kernel, arch=arch,
                    source=f"{source}; kernel from {ksource}", reason=reason)


def probe_doca(root: Root, live: Live) -> Doca:
    base = "/opt/mellanox/doca"
    for name in ("VERSION", "version"):
        text = root.read(f"{base}/{name}")
        if text:
            tools = root.exists(f"{base}/tools/doca_caps")
            return Doca(present=True, version=text.split()[0], source=f"{base}/{name}",
                        reason=f"DOCA {text.split()[0]} installed"
                               + ("" if tools else " (doca_caps tool missing)"))
    if live.run is not None:
        res = live.run(["pkg-config", "--modversion", "doca-common"], 5.0)
        if res is not None and res.rc == 0 and res.stdout.strip():
            v = res.stdout.strip()
            return Doca(present=True, version=v, source="pkg-config doca-common",
                        reason=f"DOCA {v} (pkg-config)")
    return Doca(present=False, version=None, source=f"{base}/VERSION",
                reason="DOCA not installed (no /opt/mellanox/doca/VERSION"
                       + (", pkg-config doca-common not checked)" if live.run is None
                          else ", no pkg-config doca-common)"))
