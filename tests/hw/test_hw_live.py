"""`sglang-offload detect` on the machine the tests run on, as a user runs it (a subprocess).

Asserts only what holds on any host (the report is well formed, the JSON follows the schema,
no heavy module is imported); where the host has no NVIDIA GPU (as the CPU dev box) it also
asserts the decision: path cpu with gds and dpu rejected for a named reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.hw.hw_schema_check import validate

REPO = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((REPO / "offload/hw/schema.json").read_text())


def detect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "offload.cli", "detect", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_detect_json_on_this_machine(tmp_path: Path) -> None:
    p = detect("--json", "--cache-dir", str(tmp_path))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert validate(out, SCHEMA) == []
    assert out["live"] is True and out["root"] == "/"
    facts, d = out["facts"], out["decision"]
    assert d["path"] in ("dpu", "gds", "cpu")
    assert {r["path"] for r in d["rejected"]} == {"dpu", "gds", "cpu"} - {d["path"]}
    assert all(r["check"] and r["fix"] for r in d["rejected"])
    assert facts["cache_dir"]["fs_type"] and facts["cache_dir"]["free_bytes"] is not None
    if not facts["platform"]["on_dpu_arm"]:
        assert d["role"] == "host"
    if not facts["gpus"]:
        assert d["path"] == "cpu"
        rej = {r["path"]: r["check"] for r in d["rejected"]}
        assert rej["gds"].startswith("gpu: no NVIDIA GPU")
        assert rej["dpu"].split(":")[0] in ("bluefield", "dpu_mode", "doca", "rdma_port",
                                            "agent_address", "agent_reachable", "gpu")


def test_detect_text_report_on_this_machine() -> None:
    p = detect()
    assert p.returncode == 0, p.stderr
    for part in ("Platform:", "GPUs:", "NICs / DPUs:", "NVMe:", "Cache directory:",
                 "PCIe distance", "GPUDirect RDMA:", "GPUDirect Storage:", "Decision",
                 "role:", "rejected:", "fix:"):
        assert part in p.stdout, part


def test_probe_io_measures_the_cache_directory(tmp_path: Path) -> None:
    p = detect("--json", "--cache-dir", str(tmp_path), "--probe-io", "--probe-io-seconds", "0.2")
    assert p.returncode == 0, p.stderr
    io = json.loads(p.stdout)["facts"]["io"]
    assert io["bytes"] > 0 and io["write_gbps"] > 0 and io["read_gbps"] > 0
    assert list(tmp_path.iterdir()) == []  # the probe file is removed


def test_bad_root_is_a_clean_error(tmp_path: Path) -> None:
    for root in (tmp_path / "missing", tmp_path / "file"):
        if root.name == "file":
            root.write_text("x")
        p = detect("--root", str(root))
        assert p.returncode == 2
        assert "error: root" in p.stderr and "Traceback" not in p.stderr


def test_bad_config_is_a_clean_error(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("offload:\n  transfer:\n    path: fastest\n")
    p = detect("--config", str(cfg))
    assert p.returncode == 2 and "offload.transfer.path" in p.stderr
    assert "Traceback" not in p.stderr


HEAVY = ("torch", "sglang", "kvikio", "nixl", "nixl._api", "redis", "numpy", "cupy", "cuda",
         "prometheus_client", "xxhash")
PROBE = f"""
import json, sys, io, contextlib
import offload.hw
after_import = sorted(m for m in {HEAVY!r} if m in sys.modules) + (
    ["pynvml"] if "pynvml" in sys.modules else [])
from offload.cli import main
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    rc = main(["detect", "--json"])
out = json.loads(buf.getvalue())
maps = open("/proc/self/maps").read()
print(json.dumps({{"rc": rc, "after_import": after_import,
    "heavy": sorted(m for m in {HEAVY!r} if m in sys.modules),
    "libs": sorted(l for l in ("libnvidia-ml", "libcufile", "libcuda.", "libtorch", "libnixl")
                   if l in maps),
    "nvml": out["facts"]["gpu_probe"]["nvml"], "cufile": out["facts"]["gds"]["libcufile"]}}))
"""


def test_detect_loads_no_heavy_or_absent_native_library() -> None:
    p = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["rc"] == 0
    assert r["after_import"] == []  # importing offload.hw imports nothing heavy, not even pynvml
    assert r["heavy"] == []
    if r["nvml"] != "ok":
        assert "libnvidia-ml" not in r["libs"]
    if r["cufile"] != "loads":
        assert "libcufile" not in r["libs"]
    assert not {"libcuda.", "libtorch", "libnixl"} & set(r["libs"])


def test_probe_io_measures_one_directory_per_device_and_adds_up(tmp_path: Path) -> None:
    from offload.hw.probe_io import probe_io_many

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    io = probe_io_many([str(a), str(b)], seconds=0.2, max_bytes=64 << 20)
    assert io.bytes > 0 and io.read_gbps and io.write_gbps
    assert io.reason.startswith("2 devices at once") and str(a) in io.reason and str(b) in io.reason
    assert list(a.iterdir()) == list(b.iterdir()) == []
    # two directories of the config on this one file system: measured once, as one device
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"offload:\n  store:\n    paths: [{a}, {b}]\n")
    p = detect("--json", "--config", str(cfg), "--probe-io", "--probe-io-seconds", "0.2")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert validate(out, SCHEMA) == [] and out["facts"]["io"]["path"] == str(a)
    assert "are on one device" in p.stderr
