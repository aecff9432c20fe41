"""`plan` on deployments that cannot run: exit 1, one `error:` line per reason, `--json` says so
(`runnable` false, `problems`), the least TP that fits; and the L2 sizing it gives."""

from __future__ import annotations

import json

import pytest

from offload.cli import main
from offload.plan.model import PlanInputs, make_plan
from offload.plan.presets import GPUS, preset_architecture

L70 = preset_architecture("Llama-3.1-70B")


@pytest.mark.parametrize("argv, reason", [
    # the case: 70B in BF16 on one H200 (weights 131.42 GiB > 126.36 GiB)
    (["--gpu", "H200"], "the weights do not fit: 131.42 GiB per GPU at TP 1, more than the "
     "126.36 GiB for weights + KV (mem fraction 0.9); the least TP that holds them and one "
     "131072-token context is 2"),
    # the weights fit, one 128K context (40 GiB) does not
    (["--gpu", "B200"], "not one 131072-token context fits: it takes 40.00 GiB per GPU (bf16 KV), "
     "29.74 GiB is left after the weights; the least TP that holds them and one 131072-token "
     "context is 2"),
    (["--model", "Llama-3.1-405B", "--gpu", "H100", "--tp", "8"],
     "the weights do not fit: 94.50 GiB per GPU at TP 8"),
    (["--tp", "2", "--weight-dtype", "fp8", "--hicache-size", "200", "--host-mem", "256GB"],
     "the L2 pools do not fit in host memory: 2 GPUs x 200.0 GB = 400.0 GB pinned, more than the "
     "245.3 GB of --host-mem less SGLang's 10 GiB reserve; lower hicache-size to at most 122"),
])
@pytest.mark.parametrize("fmt", [[], ["--json"], ["--comment"]])
def test_a_deployment_that_cannot_run_exits_1_saying_why(capsys, argv: list[str], reason: str,
                                                         fmt: list[str]) -> None:
    assert main(["plan", *argv, *fmt]) == 1
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and reason in errors[0] and "cannot run" in errors[0]
    assert "Traceback" not in err
    if fmt == ["--json"]:
        data = json.loads(out)
        assert data["runnable"] is False and reason in data["problems"][0]
    else:
        assert reason in out                       # the table and the comment say it too


def test_the_least_tp_counts_the_kv_dtype_and_context() -> None:
    h100 = GPUS["H100-80G"]
    bf16 = make_plan(PlanInputs(arch=L70, gpu=h100))
    assert bf16.min_tp == 4                        # 2 x H100 hold the weights, not a 40 GiB context
    short = make_plan(PlanInputs(arch=L70, gpu=h100, context=8192))
    assert short.min_tp == 2 and short.problems    # at 8K tokens the weights decide: 2 x 80 GB
    fp8 = make_plan(PlanInputs(arch=L70, gpu=h100, weight_dtype="fp8", kv_dtype="fp8"))
    assert fp8.min_tp == 2
    ok = make_plan(PlanInputs(arch=L70, gpu=h100, tp=8, gpus=8))
    assert ok.runnable and ok.problems == [] and ok.min_tp == 4


def test_plan_takes_the_hf_id_the_configs_use(capsys) -> None:
    assert main(["plan", "--model", "meta-llama/Llama-3.1-70B-Instruct", "--tp", "2",
                 "--weight-dtype", "fp8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"]["model"] == "Llama-3.1-70B"


def test_l2_sizing_for_an_l3_hit() -> None:
    # 2 x B200 TP 2 FP8 weights: a 128.30 GiB KV pool per GPU; write-through keeps its copy in the
    # L2, so an L3 hit (one 20 GiB-per-GPU context) needs 128.30 + 20 GiB = 159.2 GB of L2 per GPU
    base = dict(arch=L70, gpu=GPUS["B200-192G"], tp=2, gpus=2, weight_dtype="fp8")
    default = make_plan(PlanInputs(**base))  # type: ignore[arg-type]
    assert default.l2_bytes_per_gpu == 2 * default.kv_budget_per_gpu      # SGLang's ratio 2
    assert default.l2_for_l3_hit_bytes_per_gpu == default.kv_budget_per_gpu + 20 * (1 << 30)
    assert round(default.l2_for_l3_hit_bytes_per_gpu / 1e9, 1) == 159.2
    assert default.users[0].l2_contexts_per_replica == 6 and not default.warnings
    small = make_plan(PlanInputs(**base, l2_size=150 * 10**9))  # type: ignore[arg-type]
    assert small.users[0].l2_contexts_per_replica == 0
    assert small.warnings == [
        "the L2 pool (150.0 GB per GPU) has no room beyond its copy of the HBM pool for one whole "
        "context: an L3 hit is trimmed to the room and the rest recomputed; hicache-size 160 or "
        "more takes one"]
    # the L3 cannot add conversations through an L2 that has no room for one hit (FP8 KV row:
    # 46 at 28 GB/s with room, the 12 in HBM without)
    roomy = make_plan(PlanInputs(**base, read_gbps=28.0)).users[1]  # type: ignore[arg-type]
    l3 = make_plan(PlanInputs(**base, l2_size=135 * 10**9, read_gbps=28.0)).users[1]  # type: ignore[arg-type]
    assert roomy.conversations[1].carried == 46
    assert l3.conversations[1].carried == l3.resident_per_replica == 12
    assert "trimmed" in l3.conversations[1].limit
    ratio = make_plan(PlanInputs(**base, l2_ratio=3.0))  # type: ignore[arg-type]
    assert ratio.l2_bytes_per_gpu == 3 * ratio.kv_budget_per_gpu
    assert ratio.users[0].l2_contexts_per_replica == 12


def test_on_the_deployments_host_its_memory_bounds_the_l2(capsys, tmp_path) -> None:
    # the case: 8 x 120 GB of pinned L2 on a box with 23 GB: refused, naming MemTotal
    import shutil
    from pathlib import Path

    root = tmp_path / "host"
    shutil.copytree(Path(__file__).resolve().parents[1] / "fixtures" / "hosts" / "dgx-8nvme", root,
                    symlinks=True)
    (root / "proc" / "meminfo").write_text("MemTotal:       23000000 kB\n"
                                           "MemAvailable:   20000000 kB\n")
    cfg = tmp_path / "d.yaml"
    cfg.write_text("sglang:\n  model-path: meta-llama/Llama-3.1-70B-Instruct\n  tp-size: 8\n"
                   "  hicache-size: 120\n")
    assert main(["plan", "--config", str(cfg), "--root", str(root), "--read-gbps", "7"]) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1
    assert ("8 GPUs x 120.0 GB = 960.0 GB pinned, more than the 12.8 GB of /proc/meminfo MemTotal "
            "less SGLang's 10 GiB reserve; lower hicache-size to at most 1") in err
    # --gpu names the deployment's GPU: planning elsewhere, this host's memory is not the bound
    assert main(["plan", "--config", str(cfg), "--root", str(root), "--gpu", "H100",
                 "--read-gbps", "7"]) == 0
