"""GPU probe: NVML through `nvidia-ml-py` when it loads, else sysfs (vendor 0x10de, class 03xx).

Primitive: `probe_gpus(root, pci, live) -> (GpuProbe, tuple[Gpu, ...])`. NVML is asked only on the
live machine (`live.nvml`); on a fixture root it is `not checked` and sysfs alone answers. sysfs
fills in what NVML leaves out (NUMA node, PCI device id).
"""

from __future__ import annotations

from offload.hw.facts import Gpu, GpuProbe
from offload.hw.fsroot import Root
from offload.hw.live import NOT_CHECKED, Live
from offload.hw.pci import GPU_NAMES, PCI_DEVICES, PciDevice


def _sysfs_gpus(pci: dict[str, PciDevice]) -> list[PciDevice]:
    return sorted((d for d in pci.values() if d.is_nvidia_gpu), key=lambda d: d.bdf)


def probe_gpus(root: Root, pci: dict[str, PciDevice],
               live: Live) -> tuple[GpuProbe, tuple[Gpu, ...]]:
    sys_gpus = _sysfs_gpus(pci)
    nvml = live.nvml() if live.nvml is not None else None
    if nvml is not None and nvml.status == "ok":
        gpus = []
        for g in nvml.gpus:
            d = pci.get(g.bdf)
            numa = g.numa_node if g.numa_node is not None else (d.numa_node if d else None)
            gpus.append(Gpu(index=g.index, bdf=g.bdf, name=g.name,
                            device_id=f"0x{d.device:04x}" if d else None,
                            memory_bytes=g.memory_bytes, numa_node=numa, mig=g.mig,
                            source="nvml", reason=f"NVML device {g.index}"))
        probe = GpuProbe(nvml="ok", driver=nvml.driver, source="nvml", reason=nvml.reason)
        return probe, tuple(gpus)
    gpus = [Gpu(index=i, bdf=d.bdf, name=GPU_NAMES.get(d.device, f"NVIDIA GPU 0x{d.device:04x}"),
                device_id=f"0x{d.device:04x}", memory_bytes=None, numa_node=d.numa_node, mig=None,
                source=f"{PCI_DEVICES}/{d.bdf}",
                reason=f"PCI vendor 0x10de class 0x{d.klass:06x}")
            for i, d in enumerate(sys_gpus)]
    if nvml is None:
        probe = GpuProbe(nvml=NOT_CHECKED, driver=None, source=PCI_DEVICES,
                         reason=f"NVML {NOT_CHECKED} (fixture root); {len(gpus)} NVIDIA GPU(s) "
                                "in sysfs")
    else:
        probe = GpuProbe(nvml="unavailable", driver=None, source=PCI_DEVICES,
                         reason=f"NVML unavailable: {nvml.reason}; {len(gpus)} NVIDIA GPU(s) "
                                "in sysfs")
    return probe, tuple(gpus)
