"""Every deployment in configs/ through `launch --dry-run` on a fixture machine it fits (its GPUs)
or, for the CPU one, this machine; its warnings are exactly `detect --config`'s there."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.launch.helpers import CONFIGS, HOSTS, dry_run, run_cli

# config -> (fixture machine or "/" for this one, expected transfer path there). The GPU configs
# need their GPUs (a dry run on this CPU box refuses tp-size > 0 GPUs: test_machine_checks.py).
EXPECTED = {
    "llama-3.1-70b-128k-h100x8-nvme.yaml": [("h100x8-gds", "gds"), ("dgx-8nvme", "cpu")],
    "llama-3.1-70b-128k-h100x8-nvme-fp8kv.yaml": [("h100x8-gds", "gds")],
    "llama-3.1-70b-128k-h100x8-drives.yaml": [("dgx-8nvme", "cpu")],
    "llama-3.1-8b-128k-h200.yaml": [("h100x8-gds", "gds"), ("h100-gds-overlay", "cpu")],
    "llama-3.1-70b-128k-b200x4.yaml": [("h100x8-gds", "gds")],
    "llama-3.1-8b-128k-h100x2-bluefield3-dpu.yaml": [("h100-bf3-dpu", "dpu")],
    "llama-3.1-8b-redis-shared-replicas.yaml": [("h100x8-gds", "gds")],
    "cpu-dev.yaml": [("/", "cpu"), ("cpu-box", "cpu")],
}
CASES = [(name, root, path) for name, runs in EXPECTED.items() for root, path in runs]


def test_every_config_is_covered() -> None:
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name,root,path", CASES)
def test_dry_run(capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, root: str,
                 path: str) -> None:
    root_dir = "/" if root == "/" else str(HOSTS / root)
    # On a fixture machine SGLang's interpreter is a stand-in with every path's Python side.
    extra = () if root == "/" else ("--python", str(HOSTS.parent / "pythons" / "all-cu13"))
    config = CONFIGS / name
    if root == "/":            # this machine: the model directory must exist (demo-model's)
        config = tmp_path / name
        text = (CONFIGS / name).read_text()
        model = yaml.safe_load(text)["sglang"]["model-path"]
        config.write_text(text.replace(model, str(tmp_path)))
    out = dry_run(capsys, config, *extra, root=root_dir)
    assert out["decision"]["path"] == path
    # one warnings list: what detect says of the file on that machine, and nothing else
    rc, _, err = run_cli(capsys, "detect", "--config", str(config), "--root", root_dir, *extra)
    assert rc in (0, 1) and out["warnings"] == [e[len("warning: "):] for e in err
                                                if e.startswith("warning: ")]
    argv = out["argv"]
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert "--enable-hierarchical-cache" in argv
    assert argv[argv.index("--hicache-mem-layout") + 1] == "page_first"
    assert argv[argv.index("--hicache-storage-backend") + 1] == "dynamic"
    extra = json.loads(argv[argv.index("--hicache-storage-backend-extra-config") + 1])
    assert extra["module_path"] == "offload.hicache" and extra["class_name"] == "OffloadStorage"
    assert extra["interface_v1"] == 1 and extra["backend_name"] == "offload"
    assert "offload" not in extra and extra["config_file"] == out["settings_file"]
    assert out["config"]["offload"]["transfer"]["path"] == path
    section = yaml.safe_load(config.read_text())["sglang"]
    assert argv[argv.index("--model-path") + 1] == section["model-path"]
    if name != "cpu-dev.yaml":                  # a preset model: alignment was checked
        assert any("4 KiB-aligned" in n for n in out["notes"])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_key_is_commented(name: str) -> None:
    for n, line in enumerate((CONFIGS / name).read_text().splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            assert re.search(r"\s#\s", line), f"{name}:{n} has no comment: {line!r}"


def test_dpu_config_is_refused_on_a_machine_without_a_dpu(capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    from tests.launch.helpers import run_cli

    rc, _, err = run_cli(capsys, "launch", "--config",
                         str(CONFIGS / "llama-3.1-8b-128k-h100x2-bluefield3-dpu.yaml"),
                         "--dry-run", "--root", str(HOSTS / "cpu-box"))
    assert rc == 1
    assert len(err) == 1 and err[0].startswith("error: offload.transfer.path is 'dpu'")
    assert "bluefield" in err[0]
