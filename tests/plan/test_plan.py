"""`sglang-offload plan`: the article's figures, config.json parsing, MLA, TP, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offload.cli import main
from offload.errors import ConfigError
from offload.plan.dtypes import DTYPE_BYTES
from offload.plan.model import (
    PlanInputs,
    kv_bytes_per_token,
    kv_heads_per_rank,
    make_plan,
    prefill_flops_per_token,
    prefix_times,
    worth_loading,
)
from offload.plan.parse import parse_count, parse_tokens
from offload.plan.presets import (
    GPUS,
    MODELS,
    architecture_from_config,
    estimate_params,
    find_gpu,
    load_architecture,
    preset_architecture,
)

GiB = 1 << 30
L70 = preset_architecture("Llama-3.1-70B")
B200 = GPUS["B200-192G"]


def article(kv_dtype: str, **kw: object) -> PlanInputs:
    """The article's case: Llama-3.1-70B with FP8 weights on a TP-2 pair of B200s, 128K tokens."""
    base = dict(arch=L70, gpu=B200, context=131072, kv_dtype=kv_dtype, weight_dtype="fp8",
                tp=2, gpus=2)
    base.update(kw)
    return PlanInputs(**base)  # type: ignore[arg-type]


# --- the article's figures ---------------------------------------------------------------------

def test_llama70b_bf16_128k_is_40_gib_per_user_exactly() -> None:
    assert kv_bytes_per_token(L70, 2) == 2 * 80 * 8 * 128 * 2
    assert kv_bytes_per_token(L70, 2) * parse_tokens("128K") == 40 * GiB


def test_fp8_halves_it() -> None:
    assert kv_bytes_per_token(L70, DTYPE_BYTES["fp8"]) * 131072 == 20 * GiB


def test_about_6_users_without_offload_and_12_with_fp8() -> None:
    bf16 = make_plan(article("bf16")).users[0]
    assert bf16.kv_bytes_per_user == 40 * GiB and bf16.kv_bytes_per_user_per_rank == 20 * GiB
    assert bf16.resident == 6
    fp8 = make_plan(article("fp8")).users[0]
    assert fp8.kv_dtype == "fp8" and fp8.resident == 2 * bf16.resident == 12
    # the BF16 plan shows the FP8 row for comparison, with the same numbers
    assert make_plan(article("bf16")).users[1] == fp8


def test_the_offload_gain_is_computed_from_think_time_and_reload_time() -> None:
    # 2 x B200, TP 2, FP8 KV: 12 contexts in HBM; at 28 GB/s (4 drives) a context comes back from
    # the L3 in 0.77 s + 0.21 s from the L2: 12 x (20 + 0.98 + 60) / (20 + 0.98) = 46 carried
    fp8 = make_plan(article("fp8", read_gbps=28.0)).users[0]
    l2, l3 = fp8.conversations
    assert (l2.tier, l2.carried, l2.limit) == ("L2", 24, "L2 room")   # 12 more in the L2
    assert l3.reload_s == pytest.approx(20 * GiB / 28e9 + 10 * GiB / 50e9)
    assert (l3.by_slots, l3.carried, l3.limit) == (46, 46, "HBM slots")
    assert l3.ttft_s <= 2.0 and fp8.with_offload == 46
    # one drive (7 GB/s): 3.28 s to reload, past the 2 s TTFT target: the L3 adds nothing
    slow = make_plan(article("fp8")).users[0].conversations[1]
    assert slow.carried == 12 and "past the TTFT target 2 s" in slow.limit
    # users who think longer are carried in larger numbers; no think time, no gain
    assert make_plan(article("fp8", read_gbps=28.0, think_s=120.0)).users[0].with_offload > 46
    assert make_plan(article("fp8", read_gbps=28.0, think_s=0.0)).users[0].with_offload == 12


def test_one_b200_alone_cannot_hold_6_bf16_users_of_70b() -> None:
    # 6 x 40 GiB = 240 GiB > 179 GiB of HBM: the reason the article's case is a TP-2 pair
    assert 6 * 40 * GiB > B200.memory_bytes
    plan = make_plan(article("bf16", tp=1, gpus=1))
    assert [u.resident for u in plan.users] == [2, 4]
    # the article's 12-15 on one B200 needs FP8 KV and an L3 that reloads within the TTFT: at
    # 28 GB/s 4 contexts in HBM carry 15 conversations (think 60 s, 20 s turns, TTFT 2 s)
    one = make_plan(article("fp8", tp=1, gpus=1, read_gbps=28.0)).users[0]
    assert (one.resident, one.with_offload) == (4, 15)
    assert make_plan(article("fp8", tp=1, gpus=1)).users[0].with_offload == 8   # the L2 alone


def test_offload_users_capped_by_tier_capacity() -> None:
    free = make_plan(article("fp8", read_gbps=28.0)).users[0]
    capped = make_plan(article("fp8", read_gbps=28.0, tier_capacity=30 * 20 * GiB)).users[0]
    assert free.with_offload == 46 and capped.with_offload == 30
    assert capped.conversations[1].limit == "L3 room"
    tiny = make_plan(article("fp8", read_gbps=28.0, tier_capacity=GiB)).users[0]
    assert tiny.conversations[1].carried == tiny.resident  # resident users need no tier
    assert tiny.with_offload == 24                          # the L2 still carries its own


def test_tier_needed_for_target_users_and_hit_rate() -> None:
    plan = make_plan(article("fp8", target_users=100, hit_rate=0.5))
    assert plan.tier_bytes_needed == 50 * 20 * GiB


def test_weights_that_do_not_fit_leave_no_users() -> None:
    plan = make_plan(PlanInputs(arch=preset_architecture("Llama-3.1-405B"), gpu=GPUS["H100-80G"]))
    assert plan.kv_budget_per_gpu < 0 and plan.users[0].resident == 0
    assert plan.users[0].with_offload == 0
    assert not plan.runnable and plan.min_tp == 16
    assert plan.problems == [
        "the weights do not fit: 755.96 GiB per GPU at TP 1, more than the 71.68 GiB for weights "
        "+ KV (mem fraction 0.9); the least TP that holds them and one 131072-token context is 16"]


# --- load vs prefill -----------------------------------------------------------------------------

def test_worth_loading_rule() -> None:
    load_s, prefill_s = prefix_times(131072, 327680, 28.0, 11915.6)
    assert load_s == pytest.approx(40 * GiB / 28e9) and load_s == pytest.approx(1.53, abs=0.01)
    assert prefill_s == pytest.approx(11.0, abs=0.01)
    assert worth_loading(131072, 327680, 28.0, 11915.6)
    # a slow tier (0.5 GB/s) is slower than recomputing
    assert not worth_loading(131072, 327680, 0.5, 11915.6)
    with pytest.raises(ValueError):
        prefix_times(1, 1, 0, 1)


def test_plan_prefill_default_comes_from_gpu_flops() -> None:
    plan = make_plan(article("bf16"))
    flops = prefill_flops_per_token(L70, 131072)
    assert plan.prefill_tps_per_gpu == pytest.approx(B200.bf16_tflops * 1e12 * 0.4 / flops)
    assert plan.prefix_prefill_s == pytest.approx(131072 / (2 * plan.prefill_tps_per_gpu))
    given = make_plan(article("bf16", prefill_tps=1000.0, read_gbps=0.5))
    assert given.prefix_prefill_s == pytest.approx(131072 / 2000)
    assert given.prefix_load_s == pytest.approx(40 * GiB / 0.5e9)   # 86 s vs 66 s
    assert not given.worth_loading


# --- architectures: presets, config.json, MLA, TP -------------------------------------------------

def test_presets_parameter_estimates_match_published_counts() -> None:
    for preset in MODELS.values():
        total, active = estimate_params(preset.config)
        assert total == pytest.approx(preset.params, rel=1e-3), preset.name
        assert active <= total
    assert estimate_params(MODELS["DeepSeek-V3"].config)[1] == pytest.approx(37e9, rel=0.03)
    assert estimate_params(MODELS["Mixtral-8x7B"].config)[1] == pytest.approx(12.9e9, rel=0.01)


def test_deepseek_v3_mla_latent_one_copy() -> None:
    ds = preset_architecture("deepseek-v3")
    assert ds.mla and ds.layers == 61
    assert kv_bytes_per_token(ds, 2) == (512 + 64) * 61 * 2     # not x 2 for K and V
    assert kv_bytes_per_token(ds, 2, tp=8) == kv_bytes_per_token(ds, 2)   # every rank holds it
    plan = make_plan(PlanInputs(arch=ds, gpu=GPUS["H200-141G"], tp=8, gpus=8, weight_dtype="fp8"))
    assert plan.users[0].tier_bytes_per_user == (512 + 64) * 61 * 2 * 131072   # stored once


def test_tp_splits_kv_heads_and_replicates_past_them() -> None:
    assert kv_heads_per_rank(L70, 2) == 4
    assert kv_bytes_per_token(L70, 2, tp=8) == kv_bytes_per_token(L70, 2) // 8
    l405 = preset_architecture("Llama-3.1-405B")
    assert kv_heads_per_rank(l405, 16) == 1                    # 8 KV heads, 16 ranks: replicated
    assert kv_bytes_per_token(l405, 2, tp=16) == kv_bytes_per_token(l405, 2) // 8
    plan = make_plan(PlanInputs(arch=l405, gpu=B200, tp=16, gpus=16, weight_dtype="fp8"))
    assert plan.users[0].tier_bytes_per_user == 2 * plan.users[0].kv_bytes_per_user
    with pytest.raises(ConfigError, match="--tp 3"):
        kv_heads_per_rank(L70, 3)


def test_hf_config_json_path(tmp_path) -> None:
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
           "hidden_size": 512, "intermediate_size": 1024, "vocab_size": 1000,
           "tie_word_embeddings": True, "_name_or_path": "tiny-llama"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    arch, source = load_architecture(str(path))
    assert (arch.name, arch.layers, arch.kv_heads, arch.head_dim) == ("tiny-llama", 4, 2, 64)
    assert source == str(path)
    embed, attn, mlp = 1000 * 512 + 512, 512 * 512 * 2 + 2 * 512 * 2 * 64, 3 * 512 * 1024
    assert arch.params == embed + 4 * (attn + mlp + 2 * 512)
    assert kv_bytes_per_token(arch, 2) == 2 * 4 * 2 * 64 * 2
    # a directory holding config.json works too; --params overrides the estimate
    assert load_architecture(str(tmp_path), params=123)[0].params == 123
    rc = main(["plan", "--model", str(path), "--gpu-mem", "16GiB", "--context", "4096", "--json"])
    assert rc == 0


def test_hf_config_mla(tmp_path) -> None:
    cfg = {k: v for k, v in MODELS["DeepSeek-V3"].config.items()}
    arch = architecture_from_config(cfg, "ds")
    assert arch.kv_lora_rank == 512 and arch.qk_rope_head_dim == 64
    del cfg["qk_rope_head_dim"]
    with pytest.raises(ConfigError, match="qk_rope_head_dim"):
        architecture_from_config(cfg, "ds")


@pytest.mark.parametrize("missing", ["num_hidden_layers", "num_attention_heads"])
def test_hf_config_missing_key_is_named(tmp_path, capsys, missing: str) -> None:
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
           "head_dim": 16}
    del cfg[missing]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["plan", "--model", str(path), "--params", "1B"]) == 2
    assert f"'{missing}' missing" in capsys.readouterr().err


def test_head_dim_needs_hidden_size_when_absent() -> None:
    with pytest.raises(ConfigError, match="head_dim"):
        architecture_from_config({"num_hidden_layers": 2, "num_attention_heads": 4}, "x", 1)


# --- CLI ------------------------------------------------------------------------------------------

def test_cli_table_states_the_assumptions(capsys) -> None:
    assert main(["plan", "--tp", "2", "--gpus", "2", "--weight-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "40.00 GiB" in out and "20.00 GiB" in out
    assert "mem fraction 0.9" in out and "within a 2 s TTFT, 60 s think time, 20 s turns" in out
    assert "tokens/s per GPU" in out and "worth loading" in out


def test_cli_json_is_one_object(capsys) -> None:
    assert main(["plan", "--model", "llama-3.1-70b", "--gpu", "b200", "--tp", "2", "--gpus", "2",
                 "--weight-dtype", "fp8", "--kv-dtype", "fp8", "--context", "131072",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["users"][0]["kv_bytes_per_user"] == 20 * GiB
    assert data["users"][0]["with_offload"] == 24
    assert data["inputs"]["context"] == 131072 and isinstance(data["worth_loading"], bool)
    assert data["runnable"] is True and data["problems"] == []


@pytest.mark.parametrize("argv, needle", [
    (["--model", "Llama-9-1T"], "unknown model preset 'Llama-9-1T'; presets: Llama-3.1-8B"),
    (["--gpu", "A100"], "unknown GPU preset 'A100'; presets: H100-80G"),
    (["--kv-dtype", "int4"], "--kv-dtype 'int4'"),
    (["--context", "lots"], "--context 'lots': expected a token count"),
    (["--gpu-mem", "much"], "--gpu-mem 'much'"),
    (["--tp", "2", "--gpus", "3"], "--gpus 3 must be a positive multiple of --tp 2"),
    (["--tp", "3"], "--tp 3 must divide"),
    (["--ttft", "0"], "argument --ttft: '0': must be"),
    (["--think-s", "-1"], "--think-s -1.0: must be a finite number of seconds"),
    (["--model", "/nonexistent/config.json"], "no such config.json"),
    (["--model", "meta-llama/Llama-9-1T-Instruct"], "nor the HuggingFace id of a preset"),
    (["--users", "0"], "argument --users: '0': must be at least 1"),
    (["--context", "200K"], "--context 204800: past Llama-3.1-70B's 131,072-token context window"),
    (["--model", "Qwen2.5-72B", "--context", "64K"], "Qwen2.5-72B's 32,768-token context"),
    (["--json", "--comment"], "not allowed with argument"),
])
def test_bad_input_exits_2_naming_it(capsys, argv: list[str], needle: str) -> None:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1


def test_parsers_and_lookup() -> None:
    assert parse_tokens("128K") == parse_tokens("128k") == parse_tokens("131072") == 131072
    assert parse_tokens("1M") == 1 << 20
    assert find_gpu("H100") is find_gpu("h100-80g") is GPUS["H100-80G"]
    assert find_gpu("A100") is None


def test_article_case_holds_at_sglangs_derived_mem_fraction() -> None:
    # SGLang 0.5.23 derives ~0.857 on a B200 at TP 1 (26 GiB reserve of 179 GiB)
    bf16, fp8 = make_plan(article("bf16", mem_fraction=0.857, read_gbps=28.0)).users
    assert (bf16.resident, fp8.resident, fp8.with_offload) == (6, 12, 46)


def test_multimodal_text_config_and_counts() -> None:
    inner = {"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 32}
    arch = architecture_from_config({"text_config": inner}, "vlm", params=10)
    assert (arch.layers, arch.kv_heads, arch.head_dim) == (2, 4, 32)   # no KV heads key: MHA
    assert parse_count("70.6B", "--params") == 70_600_000_000
    assert parse_count("8030261248", "--params") == 8_030_261_248
    with pytest.raises(ConfigError, match="--params"):
        parse_count("many", "--params")


def test_tier_capacity_line_and_tier_needed_count_the_same_users(capsys) -> None:
    # 100 GiB holds 5 FP8 users, fewer than the 12 in HBM: the L3 adds none; the L2 carries 24,
    # and the tier needed is sized for those 24
    argv = ["plan", "--tp", "2", "--gpus", "2", "--weight-dtype", "fp8", "--kv-dtype", "fp8",
            "--drives", "4"]
    assert main([*argv, "--tier-capacity", "100GiB"]) == 0
    out = capsys.readouterr().out
    assert "the tier holds 5 users, fewer than the 12 in HBM: the L3 adds none" in out
    assert "for 24 users" in out
    assert "; more than --tier-capacity 100.00 GiB, which holds 5" in out
    assert main([*argv, "--tier-capacity", "10TiB"]) == 0
    out = capsys.readouterr().out
    assert "the tier holds 512 users)" in out and "for 46 users" in out


@pytest.mark.parametrize("argv, needle", [
    (["--gpu-mem", "0"], "--gpu-mem 0: must be more than 0 bytes"),
    (["--tier-capacity", "0"], "--tier-capacity 0: must be more than 0 bytes"),
    (["--prefix-tokens", "999999999999"], "--prefix-tokens '999999999999': more than"),
    (["--context", "8K", "--prefix-tokens", "16K"], "--prefix-tokens 16384: longer than a user's"),
    (["--tp", "0"], "argument --tp: '0': must be at least 1"),
    (["--users", "-3"], "argument --users: '-3': must be at least 1"),
])
def test_values_that_made_nonsense_figures_are_refused(capsys, argv: list[str],
                                                       needle: str) -> None:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_a_slow_prefill_rate_is_not_printed_as_zero(capsys) -> None:
    assert main(["plan", "--tp", "2", "--weight-dtype", "fp8", "--prefill-tps", "0.25"]) == 0
    assert "prefill rate     0.25 tokens/s per GPU" in capsys.readouterr().out


def test_several_drives_add_their_bandwidth(capsys, tmp_path) -> None:
    assert main(["plan", "--tp", "2", "--weight-dtype", "fp8", "--drives", "4"]) == 0
    out = capsys.readouterr().out
    assert "load 1.53 s at 28 GB/s (4 drives combined)" in out
    assert "at 28 GB/s aggregate per replica (4 drives x 7 GB/s)" in out
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text("sglang:\n  model-path: meta-llama/Llama-3.1-70B-Instruct\n  tp-size: 8\n"
                   "offload:\n  store:\n    paths: [/data1/kv, /data4/kv, /mnt/kv4/kv]\n")
    hosts = Path(__file__).resolve().parents[1] / "fixtures" / "hosts"
    assert main(["plan", "--config", str(cfg), "--root", str(hosts / "dgx-8nvme"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # three directories, two drives: /data4 and /mnt/kv4 are one device, counted once
    assert data["inputs"]["read_gbps"] == pytest.approx(2 * 7.88)
    assert data["inputs"]["read_drives"] == 2
    # the file's model and tp-size, the GPUs detected under the root
    assert (data["inputs"]["model"], data["inputs"]["tp"], data["inputs"]["gpus"]) == \
        ("Llama-3.1-70B", 8, 8)
    assert data["inputs"]["gpu"] == "H100-80G"
    assert "2 drives (nvme1n1, nvme4n1), ~15.8 GB/s combined" in data["inputs"]["read_source"]
    # an option given wins over the file (and detection)
    assert main(["plan", "--config", str(cfg), "--root", str(hosts / "dgx-8nvme"), "--drives", "2",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"]["read_gbps"] == 14.0 and data["inputs"]["read_drives"] == 2
