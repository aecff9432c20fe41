"""RDMA devices and GPUDirect RDMA (the peer-memory client).

Primitives: `probe_rdma(root) -> tuple[RdmaDevice, ...]` reads `/sys/class/infiniband/<dev>/`
(PCI function, firmware, HCA type, board id, and every port's state, physical state, link layer
and rate); `probe_peermem(root) -> GpuDirectRdma` looks for the files NCCL and UCX check
(`nv_mem`, `nv_mem_nc`, `nvidia_peermem`, `nv_peer_mem`). dma-buf registration, the modern
alternative, can only be probed at run time and is not claimed here.
"""

from __future__ import annotations

from offload.hw.facts import GpuDirectRdma, RdmaDevice, RdmaPort
from offload.hw.fsroot import Root

IB = "/sys/class/infiniband"
PEERMEM_FILES = (
    ("/sys/kernel/mm/memory_peers/nv_mem/version", "nv_mem peer-memory client"),
    ("/sys/kernel/mm/memory_peers/nv_mem_nc/version", "nv_mem_nc peer-memory client"),
    ("/sys/module/nvidia_peermem/version", "nvidia_peermem module"),
    ("/sys/module/nv_peer_mem/version", "nv_peer_mem module"),
)


def _state(text: str | None) -> str:
    """`4: ACTIVE` -> `ACTIVE`; missing -> `unknown`."""
    if not text:
        return "unknown"
    return text.split(":", 1)[-1].strip()


def probe_rdma(root: Root) -> tuple[RdmaDevice, ...]:
    devices = []
    for name in root.listdir(IB):
        base = f"{IB}/{name}"
        real = root.realpath(f"{base}/device")
        bdf = real.rsplit("/", 1)[-1] if real else None
        ports = []
        for p in root.listdir(f"{base}/ports"):
            if not p.isdigit():
                continue
            pb = f"{base}/ports/{p}"
            ports.append(RdmaPort(port=int(p), state=_state(root.read(f"{pb}/state")),
                                  phys_state=_state(root.read(f"{pb}/phys_state")),
                                  link_layer=root.read(f"{pb}/link_layer") or "unknown",
                                  rate=root.read(f"{pb}/rate") or "unknown"))
        ports.sort(key=lambda x: x.port)
        active = [str(x.port) for x in ports if x.state == "ACTIVE"]
        reason = (f"port(s) {', '.join(active)} ACTIVE" if active
                  else "no ACTIVE port" if ports else "no ports listed")
        devices.append(RdmaDevice(name=name, bdf=bdf, fw_ver=root.read(f"{base}/fw_ver"),
                                  hca_type=root.read(f"{base}/hca_type"),
                                  board_id=root.read(f"{base}/board_id"), ports=tuple(ports),
                                  source=base, reason=reason))
    return tuple(devices)


def probe_peermem(root: Root) -> GpuDirectRdma:
    for path, what in PEERMEM_FILES:
        if root.exists(path):
            version = root.read(path) or "?"
            return GpuDirectRdma(available=True, provider=what, source=path,
                                 reason=f"{what} loaded (version {version})")
    return GpuDirectRdma(available=False, provider=None, source=PEERMEM_FILES[0][0],
                         reason="no peer-memory client (nvidia_peermem / nv_peer_mem) is loaded")
