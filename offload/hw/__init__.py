"""Hardware detection and transfer-path selection.

Every probe reads under a root directory (default `/`), so a fixture tree stands in for a machine;
what a tree cannot hold (NVML, libcufile, mlxconfig, uname, the agent connection) is an injectable
function in `live.Live`. Importing this package loads no native library.

Public API (what launch and the transfer router call):
- `detect(cfg, root="/", cache_dir=None, live=None, env=None, python=None) -> Facts` (detect.py;
  `python`: the interpreter that runs SGLang, whose Python side of each path is checked: pyside.py)
- `decide(facts, cfg) -> Decision`: pure; an explicit `transfer.path` gds/dpu that cannot work
  raises `PathRejectedError`, a subclass of `offload.errors.PathUnavailableError`, whose `.path`,
  `.check` ("name: detail") and `.fix` say why                                   (decide.py)
- `detect_and_decide(cfg, root="/", cache_dir=None, live=None, python=None) -> (Facts, Decision)`
- `staging_numa_node(facts, cfg, gpu_index=0) -> int | None`: the NUMA node for CPU staging
  buffers and I/O threads (config override, else the GPU's, else the cache NVMe's);
  `gpu_numa_node(facts, index)`, `cache_numa_node(facts)`.
- `render_text(facts, decision)`, `to_json(facts, decision)` (report.py; schema.json).
Modules: fsroot (Root), live, pci, gpus, dpu, rdma, storage, gds, pyside, detect, decide, report,
probe_io. The command is `offload.commands.detect`.
"""

from __future__ import annotations

from offload.config import OffloadConfig
from offload.hw.decide import Decision, PathRejectedError, Rejection, decide
from offload.hw.detect import detect
from offload.hw.facts import Facts, cache_numa_node, gpu_numa_node
from offload.hw.live import Live
from offload.hw.report import render_text, to_json

__all__ = ["Decision", "Facts", "Live", "PathRejectedError", "Rejection", "cache_numa_node",
           "decide", "detect", "detect_and_decide", "gpu_numa_node", "render_text",
           "staging_numa_node", "to_json"]


def detect_and_decide(cfg: OffloadConfig, root: str = "/", cache_dir: str | None = None,
                      live: Live | None = None, python: str | None = None
                      ) -> tuple[Facts, Decision]:
    """Detect under `root` and decide. Raises DetectError (bad root) or PathRejectedError."""
    facts = detect(cfg, root=root, cache_dir=cache_dir, live=live, python=python)
    return facts, decide(facts, cfg)


def staging_numa_node(facts: Facts, cfg: OffloadConfig | None = None,
                      gpu_index: int = 0) -> int | None:
    """NUMA node for pinned buffers and I/O threads: `transfer.numa_node`, else GPU
    `gpu_index`'s node, else the node of the NVMe holding the cache directory."""
    if cfg is not None and cfg.transfer.numa_node is not None:
        return cfg.transfer.numa_node
    node = gpu_numa_node(facts, gpu_index)
    return node if node is not None else cache_numa_node(facts)
