"""PCI devices from sysfs, their identities, and the PCIe distance between two of them.

Primitives: `scan(root) -> dict[bdf, PciDevice]` reads `/sys/bus/pci/devices/*` (vendor, device,
class, numa_node, driver, and the real path: the chain of bridges above the device);
`pcie_distance(a, b) -> (level, why)` names the path between two devices the way
`nvidia-smi topo -m` does (PIX, PXB, PHB, NODE, SYS); `LEVELS` orders them. ID tables for NVIDIA
GPUs and Mellanox/NVIDIA networking (ConnectX, BlueField) come from pci.ids, rdma-core and rshim.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from offload.hw.fsroot import Root

PCI_DEVICES = "/sys/bus/pci/devices"
VENDOR_NVIDIA = 0x10DE
VENDOR_MELLANOX = 0x15B3
LEVELS = ("PIX", "PXB", "PHB", "NODE", "SYS")  # nearest first
NVSWITCH_IDS = {0x1AF1, 0x22A3}
GPU_NAMES = {0x2330: "H100 SXM5", 0x2331: "H100 PCIe", 0x2335: "H200 SXM", 0x2901: "B200"}

# device id -> (generation, role). role: net (integrated ConnectX function), vf, soc, rshim, bridge.
BLUEFIELD_IDS: dict[int, tuple[str, str]] = {
    0xA2D2: ("BlueField-1", "net"), 0xA2D3: ("BlueField-1", "vf"),
    0xA2D0: ("BlueField-1", "soc"), 0xA2D1: ("BlueField-1", "soc"),
    0xC2D2: ("BlueField-1", "rshim"), 0x1975: ("BlueField-1", "bridge"),
    0xA2D6: ("BlueField-2", "net"), 0xA2D4: ("BlueField-2", "soc"),
    0xA2D5: ("BlueField-2", "soc"), 0xC2D3: ("BlueField-2", "rshim"),
    0x1978: ("BlueField-2", "bridge"),
    0xA2D9: ("BlueField-3 Lx", "net"), 0xA2D7: ("BlueField-3 Lx", "soc"),
    0xA2D8: ("BlueField-3 Lx", "soc"), 0xC2D4: ("BlueField-3 Lx", "rshim"),
    0x197A: ("BlueField-3 Lx", "bridge"),
    0xA2DC: ("BlueField-3", "net"), 0xA2DA: ("BlueField-3", "soc"),
    0xA2DB: ("BlueField-3", "soc"), 0xC2D5: ("BlueField-3", "rshim"),
    0x197B: ("BlueField-3", "bridge"),
    0xA2DF: ("BlueField-4", "net"), 0xA2DD: ("BlueField-4", "soc"),
    0xA2DE: ("BlueField-4", "soc"), 0xC2D6: ("BlueField-4", "rshim"),
}
# Generations whose network function can serve the DPU path (HARDWARE.md decision table).
DPU_CAPABLE_NET_IDS = {0xA2D6, 0xA2D9, 0xA2DC, 0xA2DF}
CONNECTX_IDS = {0x1017: "ConnectX-5", 0x101B: "ConnectX-6", 0x101D: "ConnectX-6 Dx",
                0x101F: "ConnectX-6 Lx", 0x1021: "ConnectX-7", 0x1023: "ConnectX-8",
                0x1025: "ConnectX-9"}

_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


@dataclass(frozen=True)
class PciDevice:
    bdf: str
    vendor: int
    device: int
    klass: int
    numa_node: int | None
    driver: str | None
    chain: tuple[str, ...]  # ("pci0000:00", bridge bdf, ..., own bdf); () if the link is broken
    path: str  # machine real path (or the link path if unresolved)

    @property
    def slot(self) -> str:
        return self.bdf.rsplit(".", 1)[0]

    @property
    def function(self) -> int:
        return int(self.bdf.rsplit(".", 1)[1])

    @property
    def is_network(self) -> bool:
        return (self.klass >> 16) == 0x02

    @property
    def is_nvidia_gpu(self) -> bool:
        return (self.vendor == VENDOR_NVIDIA and (self.klass >> 16) == 0x03
                and self.device not in NVSWITCH_IDS)


def _hex(root: Root, path: str) -> int | None:
    return root.read_int(path, 16)


def scan(root: Root) -> dict[str, PciDevice]:
    devices: dict[str, PciDevice] = {}
    for bdf in root.listdir(PCI_DEVICES):
        if not _BDF.match(bdf):
            continue
        link = f"{PCI_DEVICES}/{bdf}"
        vendor, device, klass = (_hex(root, f"{link}/{n}") for n in ("vendor", "device", "class"))
        if vendor is None or device is None:
            continue
        numa = root.read_int(f"{link}/numa_node")
        drv = root.realpath(f"{link}/driver")
        real = root.realpath(link)
        chain: tuple[str, ...] = ()
        if real and real.startswith("/sys/devices/"):
            parts = real[len("/sys/devices/"):].split("/")
            if parts and parts[0].startswith("pci") and parts[-1] == bdf:
                chain = tuple(parts)
        devices[bdf] = PciDevice(
            bdf=bdf, vendor=vendor, device=device, klass=klass or 0,
            numa_node=numa if numa is not None and numa >= 0 else None,
            driver=drv.rsplit("/", 1)[-1] if drv else None, chain=chain, path=real or link)
    return devices


def level_rank(level: str) -> int:
    """0 for PIX .. 4 for SYS; 5 for unknown."""
    return LEVELS.index(level) if level in LEVELS else len(LEVELS)


def pcie_distance(a: PciDevice, b: PciDevice) -> tuple[str, str]:
    """(level, why) for the PCIe path between two devices, from their sysfs real paths.

    PIX: at most one bridge (both hang off the same switch or bridge); PXB: several bridges, no
    host bridge; PHB: through the host bridge (CPU root complex); NODE: different host bridges on
    one NUMA node; SYS: across the CPU interconnect between NUMA nodes."""
    if not a.chain or not b.chain:
        return "unknown", "a sysfs real path is missing or outside /sys/devices"
    if a.chain[0] != b.chain[0]:
        if a.numa_node is not None and b.numa_node is not None and a.numa_node != b.numa_node:
            return "SYS", (f"host bridges {a.chain[0]} and {b.chain[0]} on NUMA nodes "
                           f"{a.numa_node} and {b.numa_node}")
        why = "same NUMA node" if a.numa_node is not None and a.numa_node == b.numa_node \
            else "NUMA node unknown, assumed the same"
        return "NODE", f"different host bridges {a.chain[0]} and {b.chain[0]}, {why}"
    up_a, up_b = a.chain[1:-1], b.chain[1:-1]
    common = 0
    while common < min(len(up_a), len(up_b)) and up_a[common] == up_b[common]:
        common += 1
    if common == 0:
        return "PHB", f"they meet at host bridge {a.chain[0]}"
    below_a, below_b = len(up_a) - common, len(up_b) - common
    meet = up_a[common - 1]
    if below_a <= 1 and below_b <= 1:
        return "PIX", f"both below bridge {meet} (one switch)"
    return "PXB", f"they meet at bridge {meet} through {below_a + below_b + 1} bridges"
