"""The machine's NUMA nodes and their CPUs, read under a root path (a fixture machine in tests).

Primitives:
- `numa_nodes(root) -> list[int]`: the nodes under `<root>/sys/devices/system/node` ([] when
  the directory cannot be read).
- `node_cpus(node, root) -> set[int]`: a node's CPUs from `nodeN/cpulist` (empty when unknown).
- `parse_cpulist(text)`: the kernel's CPU list grammar (`0-3,8-11`).
"""

from __future__ import annotations

import os


def parse_cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_nodes(root: str = "/") -> list[int]:
    base = os.path.join(root, "sys/devices/system/node")
    try:
        names = os.listdir(base)
    except OSError:
        return []
    return sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit())


def node_cpus(node: int, root: str = "/") -> set[int]:
    path = os.path.join(root, f"sys/devices/system/node/node{node}/cpulist")
    try:
        with open(path) as f:
            return parse_cpulist(f.read())
    except (OSError, ValueError):
        return set()
