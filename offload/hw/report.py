"""Rendering the facts and the decision: a human report, and the `--json` object.

Primitives: `render_text(facts, decision, error, drive_set) -> str` (platform; GPU, NIC/DPU and
NVMe tables; the drives and which the cache would use (drive_set.py); the cache directories,
each judged, their combined read bandwidth and a suggested `paths:` list; GPU x NIC/DPU/NVMe
distance matrix; GPUDirect RDMA, GDS, DOCA, agent; the Python side of each path in the
interpreter that runs SGLang; then the Decision block), `to_json(facts, decision, error,
drive_set) -> dict` (schema in schema.json, `SCHEMA_VERSION`), and
`gds_status(facts) -> (status, why)`: available | compat only | unavailable
(the machine's side only: the Python side is reported on its own).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from offload.hw.decide import Decision, PathRejectedError, first_failure, gds_checks
from offload.hw.drive_set import DriveSet
from offload.hw.facts import SCHEMA_VERSION, Facts

COMPAT_CHECKS = {"cache_fs", "cufile_json", "nvfs_modules"}


def gds_status(facts: Facts) -> tuple[str, str]:
    checks = [c for c in gds_checks(facts) if c.name != "python"]
    bad = first_failure(checks)
    if bad is None:
        return "available", "; ".join(c.detail for c in checks if c.name in ("nvidia_fs",
                                                                           "cache_fs",
                                                                           "nvfs_modules"))
    failed = [c for c in checks if c.ok is False]
    if all(c.name in COMPAT_CHECKS for c in failed):
        return "compat only", f"{bad.name}: {bad.detail}"
    return "unavailable", f"{bad.name}: {bad.detail}"


def _modules(modules: tuple[str, ...] | None) -> str:
    if modules is None:
        return "- (no /proc/driver/nvidia-fs/modules)"
    return ", ".join(modules) or "none"


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= mult:
            return f"{n / mult:.1f} {unit}"
    return f"{n} B"


def _v(x: object) -> str:
    return "-" if x is None or x == "" or x == () else str(x)


def _table(headers: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    if not rows:
        return [f"{indent}(none)"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    fmt = lambda cells: indent + "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    return [fmt(headers)] + [fmt(r) for r in rows]


def _targets(facts: Facts) -> list[tuple[str, str, str]]:
    """(bdf, column label, legend) for every distance target: NIC0.., DPU0.., nvmeX."""
    seen: dict[str, tuple[str, str]] = {}
    count = {"nic": 0, "dpu": 0}
    rdma = {c.functions[0] if c.functions else c.bdf: c.rdma_devices for c in facts.nics}
    for d in facts.distances:
        if d.target in seen:
            continue
        if d.target_kind == "nvme":
            seen[d.target] = (d.target_name, f"{d.target_name} = {d.target}")
            continue
        label = f"{d.target_kind.upper()}{count[d.target_kind]}"
        count[d.target_kind] += 1
        devs = ",".join(rdma.get(d.target, ()))
        seen[d.target] = (label, f"{label} = {d.target} {d.target_name}"
                          + (f" ({devs})" if devs else ""))
    return [(bdf, label, legend) for bdf, (label, legend) in seen.items()]


def _drives(facts: Facts, ds: DriveSet | None) -> list[str]:
    """The Drives table (which the cache would use, and why) and the cache directories."""
    out: list[str] = []
    if ds is not None:
        use = {u.device: u for u in ds.drives}
        out += ["", f"Drives: {len(facts.drives)}, {len(ds.chosen)} for the cache "
                f"(the server's GPUs: {ds.gpu_nodes_reason})"]
        out += _table(["device", "NVMe", "NUMA", "fs", "mounted at", "size", "free", "use", "why"],
                      [[d.device, ",".join(d.nvme), ",".join(map(str, d.numa_nodes)) or "-",
                        _v(d.fs_type), ",".join(d.mount_points) or "-", _size(d.size_bytes),
                        _size(d.free_bytes), "yes" if use[d.device].use else "no",
                        use[d.device].reason] for d in facts.drives])
    dirs = facts.directories
    checks = ds.directories if ds is not None else ()
    out.append("")
    out.append(f"Cache directory: {dirs[0].path}" if len(dirs) == 1 else
               f"Cache directories: {len(dirs)}")
    for i, cd in enumerate(dirs):
        what = f"{cd.reason}" + (f"; {_size(cd.free_bytes)} free" if cd.free_bytes is not None
                                 else "")
        out.append(f"  {checks[i].key if checks else i}: {cd.path}: {what}" if len(dirs) > 1
                   else f"  {what}")
        out += [f"  warning: {w}" for w in (checks[i].warnings if checks else ())]
    out.append(f"  (source: {dirs[0].source})")
    if ds is not None:
        out.append(f"  read bandwidth: {ds.bandwidth}")
        if ds.suggestion:
            listed = ", ".join(ds.suggestion)
            out += [f"  suggested: offload.store.paths: [{listed}]" if len(ds.suggestion) > 1
                    else f"  suggested: offload.store.path: {listed}",
                    f"    ({ds.suggestion_reason})"]
    return out


def render_text(facts: Facts, decision: Decision | None,
                error: PathRejectedError | None = None, drive_set: DriveSet | None = None) -> str:
    out: list[str] = []
    p = facts.platform
    where = "this machine" if facts.live else f"fixture root {facts.root}"
    role = "BlueField DPU Arm cores (agent host)" if p.on_dpu_arm else "inference host"
    out.append(f"sglang-offload detect: {where}")
    out.append(f"Platform: {role}; kernel {p.kernel or 'not checked'}; "
               f"arch {p.arch or 'not checked'}")
    for e in p.evidence:
        out.append(f"  evidence: {e}")
    gp = facts.gpu_probe
    out += ["", f"GPUs: {len(facts.gpus)} ({gp.reason})"]
    out += _table(["#", "PCI", "name", "memory", "NUMA", "MIG", "source"],
                  [[str(g.index), g.bdf, g.name, _size(g.memory_bytes), _v(g.numa_node),
                    _v(g.mig), g.source] for g in facts.gpus])
    out += ["", f"NICs / DPUs: {len(facts.nics)}"]
    out += _table(["PCI", "model", "kind", "mode", "mode from", "RDMA", "net", "NUMA"],
                  [[c.bdf, c.model, c.kind, _v(c.mode), _v(c.mode_source),
                    ",".join(c.rdma_devices) or "-", ",".join(c.netdevs) or "-",
                    _v(c.numa_node)] for c in facts.nics])
    for c in facts.nics:
        if c.kind == "bluefield":
            out.append(f"  {c.bdf}: {c.reason}; functions {', '.join(c.functions) or '-'}; "
                       f"rshim {_v(c.rshim)}; evidence: {_v(c.mode_evidence)}")
    for r in facts.rdma:
        ports = ", ".join(f"{x.port}:{x.state}/{x.link_layer}/{x.rate}" for x in r.ports)
        out.append(f"  RDMA {r.name} ({_v(r.bdf)}): fw {_v(r.fw_ver)}; ports {ports or '-'}")
    out += ["", f"NVMe: {len(facts.nvme)}"]
    out += _table(["name", "model", "transport", "PCI", "link", "NUMA", "namespaces"],
                  [[n.name, _v(n.model), _v(n.transport), _v(n.bdf), _v(n.link), _v(n.numa_node),
                    ", ".join(f"{s.name} {_size(s.size_bytes)}" for s in n.namespaces) or "-"]
                   for n in facts.nvme])
    out += _drives(facts, drive_set)
    targets = _targets(facts)
    out += ["", "PCIe distance (GPU x NIC/DPU/NVMe)"]
    if not facts.gpus or not targets:
        out.append("  (no GPU)" if not facts.gpus else "  (no NIC, DPU or NVMe on PCIe)")
    else:
        level = {(d.gpu_index, d.target): d.level for d in facts.distances}
        headers = [""] + [t[1] for t in targets]
        rows = [[f"GPU{g.index}"] + [level.get((g.index, t[0]), "-") for t in targets]
                for g in facts.gpus]
        out += _table(headers, rows)
        out += [f"  {t[2]}" for t in targets if not t[1].startswith("nvme")]
        out.append("  PIX <= 1 bridge, PXB several bridges, PHB host bridge, NODE same NUMA "
                   "node, SYS across NUMA nodes")
    gdr = facts.gpudirect_rdma
    gstat, gwhy = gds_status(facts)
    out += ["", f"GPUDirect RDMA: {'available' if gdr.available else 'not available'} "
                f"({gdr.reason})",
            f"GPUDirect Storage: {gstat} ({gwhy})",
            f"  nvidia_fs {_v(facts.gds.nvidia_fs)}; libcufile {facts.gds.libcufile}; "
            f"cufile.json {_v(facts.gds.cufile_json)}" + (
                f"; storage drivers registered: {_modules(facts.gds.modules)}"
                if facts.gds.nvidia_fs else ""),
            f"DOCA: {facts.doca.reason}",
            f"Agent: {facts.agent.reason}"]
    py = facts.python
    if py is not None:
        out += ["", f"Python side: {py.executable} ({py.reason}"
                + (f"; torch {py.torch}, CUDA {py.torch_cuda or 'none'}" if py.torch else "") + ")"]
        for pp in py.paths:
            state = {True: "present", False: "MISSING", None: "not checked"}[pp.present]
            out.append(f"  {pp.path}: {state}: {pp.detail}")
            if pp.fix:
                out.append(f"    fix: {pp.fix}")
    if facts.io is not None:
        io = facts.io
        out.append(f"I/O probe: {io.reason}")
    out += ["", "Decision"]
    if decision is None:
        out.append(f"  error: {error}" if error else "  (none)")
        return "\n".join(out) + "\n"
    out.append(f"  role: {decision.role}   path: {decision.path}   (requested: "
               f"{decision.requested}; from GPU memory: {'yes' if decision.gpu_direct else 'no'}"
               + (f"; NUMA node {decision.numa_node}" if decision.numa_node is not None else "")
               + ")")
    out.append("  reasons:")
    out += [f"    - {r}" for r in decision.reasons]
    out.append("  rejected:")
    for rej in decision.rejected:
        out.append(f"    - {rej.path}: {rej.check}")
        if rej.fix:
            out.append(f"        fix: {rej.fix}")
    return "\n".join(out) + "\n"


def to_json(facts: Facts, decision: Decision | None,
            error: PathRejectedError | None = None, drive_set: DriveSet | None = None
            ) -> dict[str, Any]:
    data = dataclasses.asdict(facts)
    root, live = data.pop("root"), data.pop("live")
    gstat, gwhy = gds_status(facts)
    data["gds"]["status"] = gstat
    data["gds"]["status_reason"] = gwhy
    dec = None
    if decision is not None:
        dec = {"role": decision.role, "path": decision.path, "requested": decision.requested,
               "reasons": list(decision.reasons),
               "rejected": [dataclasses.asdict(r) for r in decision.rejected],
               "gpu_direct": decision.gpu_direct, "numa_node": decision.numa_node,
               "read_gbps": decision.read_gbps, "bandwidth": decision.bandwidth}
    err = None if error is None else {"path": error.path, "check": error.check, "fix": error.fix}
    drives = None
    if drive_set is not None:
        drives = dataclasses.asdict(drive_set)
        drives["chosen"] = [u.directory for u in drive_set.chosen]
        drives["warnings"] = list(drive_set.warnings)
    return {"schema_version": SCHEMA_VERSION, "root": root, "live": live, "facts": data,
            "decision": dec, "error": err, "drive_set": drives}
