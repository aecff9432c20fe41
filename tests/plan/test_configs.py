"""The shipped configs' sizing comments are `plan`'s output, and `plan --config` reads the whole
deployment (model, tp-size, dp-size, context, KV dtype, mem fraction, page size, L2, capacity)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from offload.cli import main
from offload.config import load_file
from offload.errors import ConfigError
from offload.plan.presets import load_architecture

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
COMMAND = re.compile(r"^# sglang-offload plan (.*--comment)$")
# a byte figure (4 MiB, 2.5 MiB/GPU, 40 GiB, 7 TB) in a comment
FIGURE = re.compile(r"\b\d+(\.\d+)?\s?(KiB|MiB|GiB|TiB|KB|MB|GB|TB)\b")
SIZED_KEYS = ("page-size", "tp-size", "context-length", "kv-cache-dtype", "mem-fraction-static",
              "hicache-size", "hicache-ratio", "capacity")


def sizing_block(path: Path) -> tuple[list[str], list[str]] | None:
    """(the plan command's arguments, the comment lines under it), or None without a block."""
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines):
        m = COMMAND.match(line)
        if m:
            block = []
            for following in lines[n + 1:]:
                if not following.startswith("#   "):
                    break
                block.append(following)
            return shlex.split(m.group(1)), block
    return None


def plannable(path: Path) -> bool:
    """Whether plan knows the config's model by a preset or its HF id. A local directory (the
    demo model's /tmp/sglang-offload-demo) is not: whether it exists depends on what ran before
    on this machine (CI, stop 40: another test had built it), not on the shipped file."""
    model = str(load_file(path).sglang.get("model-path"))
    if model.startswith(("/", "./", "../", "~")):
        return False
    try:
        load_architecture(str(model))
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_sizing_comments_are_plans_output(path: Path, capsys, monkeypatch) -> None:
    found = sizing_block(path)
    if not plannable(path):
        assert found is None, f"{path.name}: plan cannot size its model, yet it has a block"
        return
    assert found is not None, f"{path.name}: no '# sglang-offload plan ... --comment' block"
    argv, block = found
    assert argv[:2] == ["--config", f"configs/{path.name}"], "the block plans its own file"
    assert "--gpu" in argv and ("--read-gbps" in argv or "--drives" in argv), \
        "the command names the GPU and the bandwidth: its output is the same on every machine"
    monkeypatch.chdir(ROOT)
    assert main(["plan", *argv]) == 0
    assert block == capsys.readouterr().out.splitlines(), (
        f"{path.name}: the sizing comment differs from `sglang-offload plan {shlex.join(argv)}`;"
        " paste its output under the command")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_no_hand_written_size_figures_beside_sizing_keys(path: Path) -> None:
    # a figure plan computes (a block's bytes, a context's, the HBM or L2 room) lives in the
    # computed block only; the demo model's (cpu-dev) is not a model plan can read
    if not plannable(path):
        return
    for n, line in enumerate(path.read_text().splitlines(), 1):
        key, _, comment = line.partition("#")
        if any(key.strip().startswith(f"{k}:") for k in SIZED_KEYS):
            assert not FIGURE.search(comment), f"{path.name}:{n}: {line.strip()!r}"


def test_the_70b_nvme_config_is_sized_right(capsys, monkeypatch) -> None:
    # the case: 5 GiB per GPU per 128K context at TP 8, blocks of 2.5 MiB (K and V), the
    # 120 GB L2 per GPU holds ~12 contexts besides its HBM copy, 6 TiB holds 153 (not thousands)
    monkeypatch.chdir(ROOT)
    assert main(["plan", "--config", "configs/llama-3.1-70b-128k-h100x8-nvme.yaml", "--gpu",
                 "H100", "--drives", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    i, u = data["inputs"], data["users"][0]
    assert (i["model"], i["tp"], i["gpus"], i["context"], i["kv_dtype"]) == \
        ("Llama-3.1-70B", 8, 8, 131072, "bf16")
    assert i["mem_fraction"] == 0.85 and i["tier_capacity"] == 6 << 40
    assert u["kv_bytes_per_user_per_rank"] == 5 << 30
    assert data["block_bytes_per_gpu"] == 64 * 40 << 10 == 2.5 * (1 << 20)
    assert data["l2_bytes_per_gpu"] == 120e9 and data["tier_users_capacity"] == 153
    assert u["resident"] == 10 and u["l2_contexts_per_replica"] == 12


def test_plan_config_reads_kv_dtype_dp_and_ratio(capsys, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    fp8 = "configs/llama-3.1-70b-128k-h100x8-nvme-fp8kv.yaml"
    assert main(["plan", "--config", fp8, "--gpu", "H100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"]["kv_dtype"] == "fp8" and data["block_bytes_per_gpu"] == 64 * 20 << 10
    dpu = "configs/llama-3.1-8b-128k-h100x2-bluefield3-dpu.yaml"
    assert main(["plan", "--config", dpu, "--gpu", "H100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["inputs"]["gpus"], data["replicas"]) == (2, 2)          # dp-size 2
    assert data["inputs"]["l2_ratio"] == 2.0
    assert data["l2_bytes_per_gpu"] == 2 * data["kv_budget_per_gpu"]
    assert data["inputs"]["tier_capacity"] is None                       # the agent's own
    # an option given wins over the file
    assert main(["plan", "--config", fp8, "--gpu", "H100", "--kv-dtype", "bf16", "--tp", "4",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["inputs"]["kv_dtype"], data["inputs"]["tp"]) == ("bf16", 4)


def test_plan_config_without_a_gpu_asks_for_one(capsys, tmp_path) -> None:
    # nothing under an empty root: plan does not guess a B200
    cfg = tmp_path / "d.yaml"
    cfg.write_text("sglang:\n  model-path: meta-llama/Llama-3.1-8B-Instruct\n")
    assert main(["plan", "--config", str(cfg), "--root", str(tmp_path), "--read-gbps", "7"]) == 2
    err = capsys.readouterr().err
    assert "--gpu: no GPU with a preset found under" in err and err.count("error:") == 1


@pytest.mark.parametrize("sglang, needle", [
    ("context-length: 200000", "sglang.context-length: 200000 is past Llama-3.1-8B's 131,072"),
    ("tp-size: zero", "sglang.tp-size: 'zero' is not a positive integer"),
    ("kv-cache-dtype: fp4_e2m1", "sglang.kv-cache-dtype 'fp4_e2m1': one of bf16, fp16, fp8"),
    ("quantization: bitsandbytes", "sglang.quantization: 'bitsandbytes'"),
    ("mem-fraction-static: 1.5", "sglang.mem-fraction-static: 1.5 is more than 1"),
])
def test_a_config_value_plan_cannot_use_is_named(capsys, tmp_path, sglang: str,
                                                   needle: str) -> None:
    cfg = tmp_path / "d.yaml"
    cfg.write_text(f"sglang:\n  model-path: meta-llama/Llama-3.1-8B-Instruct\n  {sglang}\n")
    assert main(["plan", "--config", str(cfg), "--gpu", "H100", "--read-gbps", "7"]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("error:") == 1 and "Traceback" not in err


def test_a_model_path_plan_cannot_read_is_named(capsys, tmp_path) -> None:
    cfg = tmp_path / "d.yaml"
    cfg.write_text(f"sglang:\n  model-path: {tmp_path}/no-such-model\n")
    assert main(["plan", "--config", str(cfg), "--gpu", "H100", "--read-gbps", "7"]) == 2
    err = capsys.readouterr().err
    assert f"error: sglang.model-path {tmp_path}/no-such-model: no such config.json" in err
    assert err.count("error:") == 1


def test_probe_io_measures_the_stores_read_rate(capsys, tmp_path) -> None:
    store = tmp_path / "kv"
    store.mkdir()
    cfg = tmp_path / "d.yaml"
    cfg.write_text(f"sglang:\n  model-path: meta-llama/Llama-3.1-8B-Instruct\n"
                   f"offload:\n  store:\n    path: {store}\n")
    assert main(["plan", "--config", str(cfg), "--gpu", "H100", "--probe-io", "0.2",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"]["read_gbps"] > 0 and data["inputs"]["read_drives"] == 1
    assert data["inputs"]["read_source"].startswith("measured by --probe-io: ")
    assert not list(store.iterdir())                      # the probe's file is removed


@pytest.mark.parametrize("extra, needle", [
    (["--root", "{hosts}/dgx-8nvme"], "is a fixture tree, not this machine"),
    (["--read-gbps", "7"], "--probe-io measures the bandwidth --read-gbps/--drives give"),
    (["--no-config"], "--probe-io: measures the drives of a deployment file: give --config"),
])
def test_probe_io_refuses_what_it_cannot_measure(capsys, tmp_path, extra: list[str],
                                                 needle: str) -> None:
    cfg = tmp_path / "d.yaml"
    cfg.write_text("sglang:\n  model-path: meta-llama/Llama-3.1-8B-Instruct\n")
    hosts = ROOT / "tests" / "fixtures" / "hosts"
    argv = ["plan", "--gpu", "H100", "--probe-io", "0.1"]
    argv += [] if extra == ["--no-config"] else ["--config", str(cfg),
                                                 *[e.format(hosts=hosts) for e in extra]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("error:") == 1
