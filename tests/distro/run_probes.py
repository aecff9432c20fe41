"""Run several probe modules (tests/distro/probe_<name>.py) in one interpreter, so SGLang is
imported once per tree under test. Prints `PROBE {"<name>": <probe() result>, ...}`; a probe that
raises is reported as {"exception": "..."} and the others still run.

    python tests/distro/run_probes.py imports cache_salt offload_backend
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(names: list[str]) -> None:
    results = {}
    for name in names:
        try:
            results[name] = importlib.import_module(f"probe_{name}").probe()
        except Exception:  # the test shows the traceback
            results[name] = {"exception": traceback.format_exc()}
    print("PROBE " + json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
