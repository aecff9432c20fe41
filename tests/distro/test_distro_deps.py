"""distro/sglang-cpu-deps.txt and distro/sglang-cpu-serve-deps.txt are enough for SGLang on CPU, and
minimal.

- HiCache list: SGLang's HiCache modules (and the server-argument parser `launch` uses) import, and
  every line is imported by them.
- Serving list: a real `python -m sglang.launch_server` on the CPU engine (the demo model, HiCache
  with the offload tier as L3) starts and answers a request long enough to hash pages (the first
  such request JIT-builds SGLang's hicache_hash_cpp with g++/ninja); every line of the list is
  imported by one of the server's processes (PYTHONPROFILEIMPORTTIME, inherited by the scheduler
  and detokenizer processes, logs every module each one imports).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from offload.errors import RunError
from offload.launch.server import LaunchedServer, free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DEPS = REPO / "distro" / "sglang-cpu-deps.txt"
SERVE_DEPS = REPO / "distro" / "sglang-cpu-serve-deps.txt"
MODULES = ["sglang.srt.mem_cache.hicache_storage", "sglang.srt.mem_cache.storage.backend_factory",
           "sglang.srt.mem_cache.memory_pool_host", "sglang.srt.managers.cache_controller",
           "sglang.srt.server_args"]
START_TIMEOUT_S = 300  # a hung start fails the test instead of blocking CI

PROBE = f"""
import importlib, importlib.metadata as md, json, sys
for m in {MODULES!r}:
    importlib.import_module(m)
dists = md.packages_distributions()
used = sorted({{d.lower().replace("_", "-") for m in list(sys.modules)
               for d in dists.get(m.split(".")[0], [])}})
print(json.dumps(used))
"""


def _requirements(path: Path) -> list[tuple[str, bool]]:
    out = []
    for line in path.read_text().splitlines():
        spec = line.split("#")[0].strip()
        if spec:
            name = re.split(r"[=<>!~\[; ]", spec, maxsplit=1)[0].strip().lower()
            out.append((name.replace("_", "-"), "# pin" in line))
    return out


def _distributions(top_level_modules: set[str]) -> set[str]:
    import importlib.metadata as md

    dists = md.packages_distributions()
    return {d.lower().replace("_", "-") for m in top_level_modules for d in dists.get(m, [])}


def test_the_list_is_enough_and_minimal():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]  # enough: every module imports
    used = set(json.loads(r.stdout.strip().splitlines()[-1]))
    unused = [name for name, pin in _requirements(DEPS) if not pin and name not in used]
    assert not unused, f"listed but not imported by SGLang's HiCache modules: {unused}"


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    """Start a real CPU server with import-time logging, send one request, stop it; what it did."""
    from offload.demo import DemoSpec, write_demo

    tmp = tmp_path_factory.mktemp("serve")
    write_demo(tmp / "model", DemoSpec(layers=2, hidden=128, intermediate=256))
    port = free_port()
    extra = {"backend_name": "offload", "module_path": "offload.hicache",
             "class_name": "OffloadStorage", "interface_v1": 1,
             "offload": {"store": {"path": str(tmp / "store"), "capacity": "1GiB", "min_free": "0"},
                         "transfer": {"path": "cpu"}}}
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(tmp / "model"),
            "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
            "--host", "127.0.0.1", "--port", str(port), "--page-size", "64",
            "--max-total-tokens", "8192", "--enable-hierarchical-cache", "--hicache-ratio", "2",
            "--hicache-storage-backend", "dynamic",
            "--hicache-storage-backend-extra-config", json.dumps(extra)]
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", PYTHONPROFILEIMPORTTIME="1", UCX_MODULES="^ib")
    log = tmp / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp,
                                start_new_session=True)
    server = LaunchedServer(f"http://127.0.0.1:{port}", proc, log)
    result: dict = {"log": log}
    try:
        server.wait_ready(START_TIMEOUT_S)
        prompt = " ".join(f"w{i % 97}" for i in range(600))  # several 64-token pages
        result["response"] = _post(server.url + "/generate", {
            "text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 4}})
    except RunError:
        pass                      # it exited or never answered: the tests show the log's tail
    finally:
        server.stop(grace=60)     # its own process group (start_new_session)
    text = log.read_text(errors="replace")
    result["modules"] = {m.group(1).split(".")[0]
                         for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", text, re.M)}
    result["tail"] = "\n".join(ln for ln in text.splitlines()
                               if not ln.startswith("import time:"))[-3000:]
    return result


def test_a_real_cpu_server_starts_and_serves_with_the_lists(served):
    response = served.get("response")
    assert response is not None, f"the server did not serve:\n{served['tail']}"
    assert response["meta_info"]["prompt_tokens"] > 64 and isinstance(response["text"], str)


def test_the_serving_list_is_minimal(served):
    assert served.get("response") is not None, served["tail"]
    used = _distributions(served["modules"])
    unused = [name for name, pin in _requirements(SERVE_DEPS) if not pin and name not in used]
    assert not unused, f"listed but not imported by a real server start: {unused}"
