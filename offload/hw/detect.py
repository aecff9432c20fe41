"""Run every probe under a root and gather the facts.

Primitive: `detect(cfg, root="/", cache_dir=None, live=None, env=None, python=None) -> Facts`.
- `root`: the machine's file tree (`/`, or a fixture under tests/fixtures/hosts/). A missing or
  unreadable root raises `DetectError`.
- `cache_dir`: a machine path (inside the root); default every directory of the config
  (`cfg.store.directories()`: `paths`, or the one `path`), each probed (`Facts.cache_dirs`;
  `Facts.cache_dir` is the first). `Facts.drives`: every NVMe drive and what is mounted from it
  (drives.py; which of them the cache should use is drive_set.py).
- `live`: the injectable live probes; default `Live.default()` on `/` and `Live.offline()` on any
  other root, where NVML, libcufile, mlxconfig and the agent connection are `not checked`.
- `env`: environment for `CUFILE_ENV_PATH_JSON` and `CUDA_VISIBLE_DEVICES` (the server's GPUs);
  default `os.environ` on `/`, `{}` elsewhere.
- `python`: the interpreter that will run SGLang (default this one); its Python side of every
  path (pyside.py) is asked under any root, since it is a fact of that interpreter.
Nothing here imports a native library; only `live` functions load one, and only if present.
With debug logging (`sglang-offload -v detect`) every fact is logged with where it was read.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any, Iterator, Mapping

from offload.config import OffloadConfig
from offload.hw.dpu import probe_cards, probe_doca, probe_platform
from offload.hw.drives import probe_drives
from offload.hw.facts import AgentFact, Distance, Facts, Gpu
from offload.hw.fsroot import Root
from offload.hw.gds import probe_gds
from offload.hw.gpus import probe_gpus
from offload.hw.live import NOT_CHECKED, Live
from offload.hw.pci import PciDevice, pcie_distance, scan
from offload.hw.pyside import probe_python
from offload.hw.rdma import probe_peermem, probe_rdma
from offload.hw.storage import probe_cache_dir, probe_nvme

log = logging.getLogger("offload.hw.detect")


def _sourced(name: str, value: Any) -> Iterator[tuple[str, str, str]]:
    """(fact, source, reason) of every record under `value` that says where it was read."""
    if isinstance(value, tuple):
        for i, item in enumerate(value):
            yield from _sourced(f"{name}[{i}]", item)
    elif dataclasses.is_dataclass(value) and hasattr(value, "source"):
        yield name, str(getattr(value, "source")), str(getattr(value, "reason", ""))


def log_facts(facts: Facts) -> None:
    """One debug line per fact: what it says and where it was read (a machine path, nvml, ...)."""
    if not log.isEnabledFor(logging.DEBUG):
        return
    for field in dataclasses.fields(facts):
        for name, source, reason in _sourced(field.name, getattr(facts, field.name)):
            log.debug("%s: %s (source: %s)", name, reason, source)


def _distances(gpus: tuple[Gpu, ...], pci: dict[str, PciDevice],
               targets: list[tuple[str, str, str]]) -> tuple[Distance, ...]:
    out = []
    for g in gpus:
        gd = pci.get(g.bdf)
        for bdf, kind, name in targets:
            td = pci.get(bdf)
            if gd is None or td is None:
                level, why = "unknown", f"{g.bdf if gd is None else bdf} is not in sysfs"
            else:
                level, why = pcie_distance(gd, td)
            out.append(Distance(gpu=g.bdf, gpu_index=g.index, target=bdf, target_kind=kind,
                                target_name=name, level=level, source="/sys/bus/pci/devices "
                                "real paths", reason=why))
    return tuple(out)


def _agent(cfg: OffloadConfig, live: Live) -> AgentFact:
    address = cfg.agent.address
    if address is None:
        return AgentFact(address=None, reachable=None, source="config",
                         reason="offload.agent.address is not set")
    if live.connect is None:
        return AgentFact(address=address, reachable=None, source=NOT_CHECKED,
                         reason=f"agent {address}: connection {NOT_CHECKED} (fixture root)")
    ok, why = live.connect(address, min(cfg.agent.timeout_s, 2.0))
    return AgentFact(address=address, reachable=ok, source="tcp connect", reason=why)


def detect(cfg: OffloadConfig, root: str = "/", cache_dir: str | None = None,
           live: Live | None = None, env: Mapping[str, str] | None = None,
           python: str | None = None) -> Facts:
    r = Root(root)
    if live is None:
        live = Live.default() if r.live else Live.offline()
    if env is None:
        env = os.environ if r.live else {}
    log.debug("reading the machine under %s (%s)", r.path,
              "live: NVML, libcufile, tools, agent connection" if r.live else "fixture root: no live probe")
    pci = scan(r)
    log.debug("pci: %d device(s) under %s", len(pci), r.host("/sys/bus/pci/devices"))
    platform = probe_platform(r, pci, live)
    gpu_probe, gpus = probe_gpus(r, pci, live)
    rdma = probe_rdma(r)
    cards = probe_cards(r, pci, rdma, cfg.hw.dpu_mode, live)
    nvme = probe_nvme(r, pci)
    targets = [(c.functions[0] if c.functions else c.bdf,
                "dpu" if c.kind == "bluefield" else "nic", c.model) for c in cards]
    targets += [(n.bdf, "nvme", n.name) for n in nvme if n.bdf]
    cache_dirs = tuple(probe_cache_dir(r, d) for d in
                       ([cache_dir] if cache_dir else cfg.store.directories()))
    facts = Facts(
        root=r.path, live=r.live, platform=platform, gpu_probe=gpu_probe, gpus=gpus,
        nics=cards, rdma=rdma, doca=probe_doca(r, live), gpudirect_rdma=probe_peermem(r),
        gds=probe_gds(r, live, env), nvme=nvme,
        cache_dir=cache_dirs[0], distances=_distances(gpus, pci, targets), agent=_agent(cfg, live),
        python=probe_python(live, python or sys.executable, cfg.agent.transport),
        drives=probe_drives(r, nvme), cache_dirs=cache_dirs,
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"))
    log_facts(facts)
    return facts
