"""Probe: import every module patches/ touches, from whichever SGLang is first on sys.path.

`probe()` returns sglang_file, the installed distribution version, and module -> __file__.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def patched_modules() -> list[str]:
    series = (REPO / "patches" / "series").read_text().splitlines()
    names = [ln.split("#", 1)[0].split()[0] for ln in series if ln.split("#", 1)[0].strip()]
    modules = set()
    for name in names:
        for line in (REPO / "patches" / name).read_text().splitlines():
            if line.startswith("+++ b/") and line.split("\t")[0].endswith(".py"):
                path = line[len("+++ b/"):].split("\t")[0]
                modules.add(path[: -len(".py")].replace("/", "."))
    return sorted(modules)


def probe() -> dict:
    import sglang

    return {
        "sglang_file": sglang.__file__,
        "version": importlib.metadata.version("sglang"),
        "modules": {m: importlib.import_module(m).__file__ for m in patched_modules()},
    }


if __name__ == "__main__":
    print("PROBE " + json.dumps(probe()))
