"""`fake_numa(root, {node: cpulist})`: a sysfs tree of NUMA nodes under `root`, for the probes that
read `<root>/sys/devices/system/node/node<N>/cpulist`."""

from __future__ import annotations

from pathlib import Path


def fake_numa(root: Path, nodes: dict[int, str]) -> str:
    for n, cpus in nodes.items():
        d = root / f"sys/devices/system/node/node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    return str(root)
