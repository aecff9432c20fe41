"""The Python side at launch: on a GDS fixture host whose SGLang interpreter lacks kvikio, launch
falls back to cpu and names the fix; forcing gds there refuses at launch (exit 1), before SGLang
would start. The interpreters are stand-ins under tests/fixtures/pythons/ (the machine's python3
with stub packages only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from offload.hw.pyside import checkout
from tests.launch.helpers import CONFIGS, HOSTS, dry_run, run_cli, write

PYTHONS = HOSTS.parent / "pythons"
GDS_CONFIG = CONFIGS / "llama-3.1-70b-128k-h100x8-nvme.yaml"
FIX = f"-m pip install -e '{checkout()}[gds-cu13]'"   # the checkout


def test_gds_host_without_kvikio_falls_back_to_cpu_with_the_fix(capsys) -> None:
    out = dry_run(capsys, GDS_CONFIG, "--python", str(PYTHONS / "no-kvikio-cu13"),
                  root=str(HOSTS / "h100x8-gds"))
    assert out["decision"]["path"] == "cpu"
    gds = next(r for r in out["decision"]["rejected"] if r["path"] == "gds")
    assert gds["check"].startswith("python: kvikio is not importable by ")
    assert gds["fix"].endswith(FIX)
    assert out["argv"][0] == str(PYTHONS / "no-kvikio-cu13")
    same = dry_run(capsys, GDS_CONFIG, "--python", str(PYTHONS / "all-cu13"),
                   root=str(HOSTS / "h100x8-gds"))
    assert same["decision"]["path"] == "gds"


def test_text_dry_run_names_the_fix(capsys) -> None:
    rc, out, err = run_cli(capsys, "launch", "--config", str(GDS_CONFIG), "--dry-run", "--root",
                           str(HOSTS / "h100x8-gds"), "--python", str(PYTHONS / "no-kvikio-cu13"))
    assert rc == 0, err
    assert "path: cpu" in out and FIX in out


@pytest.mark.parametrize("python,check", [
    ("no-kvikio-cu13", "python: kvikio is not importable"),
    ("kvikio12-torch13", "python: kvikio-cu12 26.10.0 is built for CUDA 12 but torch for CUDA 13.0"),
])
def test_forced_gds_without_its_python_side_refuses_at_launch(capsys, tmp_path: Path,
                                                               python: str, check: str) -> None:
    cfg = write(tmp_path, "sglang:\n  model-path: Qwen/Qwen2.5-0.5B-Instruct\n"
                "offload:\n  store:\n    path: /raid/kv\n  transfer:\n    path: gds\n")
    rc, out, err = run_cli(capsys, "launch", "--config", str(cfg), "--dry-run", "--root",
                           str(HOSTS / "h100x8-gds"), "--python", str(PYTHONS / python))
    assert rc == 1 and out == ""
    assert err[0].startswith("error: offload.transfer.path is 'gds' but it cannot work here: "
                             + check)
    assert FIX in err[0]


def test_redis_url_without_redis_py_refuses_at_launch(capsys, tmp_path: Path) -> None:
    cfg = write(tmp_path, "sglang:\n  model-path: Qwen/Qwen2.5-0.5B-Instruct\n"
                "offload:\n  redis:\n    url: redis://127.0.0.1:6379/0\n")
    rc, out, err = run_cli(capsys, "launch", "--config", str(cfg), "--dry-run", "--root",
                           str(HOSTS / "cpu-box"), "--python", str(PYTHONS / "bare"))
    assert rc == 1
    assert err[0].startswith("error: offload.redis.url is set but the Redis tier cannot work "
                             "here: python: redis is not importable")
    assert f"-m pip install -e '{checkout()}[redis]'" in err[0]
