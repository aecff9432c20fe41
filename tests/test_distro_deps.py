"""distro/sglang-cpu-deps.txt is enough for SGLang's HiCache modules on CPU, and minimal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

DEPS = Path(__file__).resolve().parents[1] / "distro" / "sglang-cpu-deps.txt"
MODULES = ["sglang.srt.mem_cache.hicache_storage", "sglang.srt.mem_cache.storage.backend_factory",
           "sglang.srt.mem_cache.memory_pool_host", "sglang.srt.managers.cache_controller",
           "sglang.srt.server_args"]

PROBE = f"""
import importlib, importlib.metadata as md, json, sys
for m in {MODULES!r}:
    importlib.import_module(m)
dists = md.packages_distributions()
used = sorted({{d.lower().replace("_", "-") for m in list(sys.modules)
               for d in dists.get(m.split(".")[0], [])}})
print(json.dumps(used))
"""


def _requirements() -> list[tuple[str, bool]]:
    out = []
    for line in DEPS.read_text().splitlines():
        spec = line.split("#")[0].strip()
        if spec:
            name = spec.split("=")[0].split("<")[0].split(">")[0].strip().lower()
            out.append((name.replace("_", "-"), "# pin" in line))
    return out


def test_the_list_is_enough_and_minimal():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]  # enough: every module imports
    used = set(json.loads(r.stdout.strip().splitlines()[-1]))
    unused = [name for name, pin in _requirements() if not pin and name not in used]
    assert not unused, f"listed but not imported by SGLang's HiCache modules: {unused}"
