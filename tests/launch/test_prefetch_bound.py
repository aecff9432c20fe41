"""Launch bounds SGLang's wait for an L3 prefetch: no longer than recomputing, capped (issue 35).

SGLang's own `timeout` policy waits 1 s + 0.25 s per 1K tokens with no cap (33 s at 128K) and
`wait_complete` waits for ever; launch gives SGLang a deadline line (base 0, a per-1K-token
wait) under both the recompute estimate and the cap. The formula is SGLang's own, checked here
against its code.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from offload.launch.prefetch import (
    ASSUMED_CONTEXT,
    Recompute,
    decide,
    sglang_wait_s,
    wait_line,
)
from tests.launch.helpers import HOSTS, dry_run, run_cli, write

CPU = ("sglang:\n  model-path: m\n  device: cpu\n  page-size: 64\n  context-length: 16384\n"
       "offload:\n  store: {path: /tmp/x}\n")
GPU = ("sglang:\n  model-path: meta-llama/Llama-3.1-8B-Instruct\n  context-length: 131072\n"
       "  page-size: 64\noffload:\n  store: {path: /tmp/x}\n")
PAGE = 64


def _extra(out: dict) -> dict:
    argv = out["argv"]
    return json.loads(argv[argv.index("--hicache-storage-backend-extra-config") + 1])


def _prefetch_reason(out: dict) -> str:
    return next(r for r in out["device"]["reasons"] if "prefetch" in r)


# ------------------------------------------------------------------ the deadline line


@pytest.mark.parametrize("tps,context,cap", [(700.0, 16384, 30.0), (700.0, 131072, 30.0),
                                             (16000.0, 131072, 30.0), (16000.0, 1 << 20, 10.0),
                                             (None, 16384, 30.0), (None, 131072, 5.0)])
def test_no_prefetch_waits_longer_than_recomputing_it_nor_past_the_cap(
        tps: float | None, context: int, cap: float) -> None:
    line = wait_line(Recompute(tps, "test", context, "test"), cap)
    assert line.base_s == 0.0
    for tokens in range(256, context + 1, max(PAGE, context // 512)):
        wait = sglang_wait_s(tokens, PAGE, line.base_s, line.per_ki_token_s)
        assert wait <= cap + 1e-9, (tokens, wait)
        if tps is not None:
            assert wait <= tokens / tps + 1e-9, (tokens, wait)
    assert line.longest_s == pytest.approx(min(cap, context / tps) if tps else cap)


def test_the_recompute_estimate_sets_the_slope_until_the_cap_would_be_passed() -> None:
    fast = wait_line(Recompute(16000.0, "t", 131072, "t"), 30.0)      # an 8B model on an H100
    assert fast.bound_by == "recompute" and fast.per_ki_token_s == pytest.approx(1024 / 16000)
    assert fast.longest_s == pytest.approx(8.192)                     # not SGLang's 33 s
    slow = wait_line(Recompute(700.0, "t", 131072, "t"), 30.0)        # a CPU: 187 s to recompute
    assert slow.bound_by == "cap" and slow.longest_s == pytest.approx(30.0)


def test_sglangs_own_defaults_have_no_cap() -> None:
    """The issue's figure: 1 s + 0.25 s per 1K tokens is 33 s for a 128K-token prompt."""
    assert sglang_wait_s(131072, PAGE, 1.0, 0.25) == pytest.approx(33.0)


def test_the_formula_is_sglangs() -> None:
    """SGLang's own code: the extra config parsed as the server parses it, the per-page wait as
    its storage attachment sets it, and the deadline its radix cache gives a blocked prefetch."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.unified_cache.storage_attachment import StorageAttachment
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    line = wait_line(Recompute(700.0, "t", 16384, "t"), 30.0)
    extra = {"prefetch_timeout_base": line.base_s,
             "prefetch_timeout_per_ki_token": line.per_ki_token_s, "backend_name": "offload"}
    parsed = HybridCacheController.parse_storage_backend_extra_config(json.dumps(extra))
    rest, _threshold, base, per_ki, _keys = parsed
    assert (base, per_ki) == (line.base_s, line.per_ki_token_s) and rest == {
        "backend_name": "offload"}
    # The attributes SGLang's methods read, on a plain object (no GPU pools needed for these).
    cache = SimpleNamespace(page_size=PAGE, enable_storage=True, prefetch_stop_policy="timeout",
                            _storage_prefetch_wait={}, tree_core=None)
    att = StorageAttachment.__new__(StorageAttachment)
    att._cache = cache
    att.apply_runtime_config(storage_backend=None, prefetch_threshold=256,
                             prefetch_timeout_base=base, prefetch_timeout_per_ki_token=per_ki,
                             hicache_storage_pass_prefix_keys=False, enable_storage=True,
                             enable_storage_metrics=False, extra_metric_labels=None)
    for tokens in (256, 1200, 8192, 16384):
        op = SimpleNamespace(handle=("req", tokens), stats_requested_tokens=tokens)
        UnifiedRadixCache._start_storage_prefetch_wait(cache, op)
        got = cache._storage_prefetch_wait[op.handle].timeout_s
        assert got == pytest.approx(sglang_wait_s(tokens, PAGE, base, per_ki)), tokens
        assert got <= min(30.0, tokens / 700.0) + 1e-9


# ------------------------------------------------------------------ the decision (pure)


def _values(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"device": "cpu", "hicache_storage_prefetch_policy": "timeout",
                                 **kw})


def test_a_policy_the_user_set_is_named_with_what_it_costs() -> None:
    rec = Recompute(None, "t", 16384, "context-length")
    got = decide(_values(hicache_storage_prefetch_policy="wait_complete"),
                 {"hicache_storage_prefetch_policy"}, {}, rec, 30.0)
    assert got.argv == [] and got.extra == {}
    assert got.reason.startswith("--hicache-storage-prefetch-policy wait_complete: set in the "
                                 "config, it waits for ever on a stalled tier (launch would "
                                 "pick timeout")
    best = decide(_values(hicache_storage_prefetch_policy="best_effort"),
                  {"hicache_storage_prefetch_policy"}, {}, rec, 30.0)
    assert best.extra == {} and "never waits" in best.reason


def test_keys_the_user_set_in_the_extra_config_are_kept_and_their_longest_wait_named() -> None:
    rec = Recompute(None, "t", 131072, "context-length")
    got = decide(_values(), set(), {"prefetch_timeout_base": 1, "prefetch_timeout_per_ki_token":
                                    0.25}, rec, 30.0)
    assert got.extra == {}
    assert "set in the extra config; a 131,072-token prompt waits up to 33.0 s" in got.reason
    one = decide(_values(), set(), {"prefetch_timeout_base": 0.5}, rec, 30.0)
    assert set(one.extra) == {"prefetch_timeout_per_ki_token"}


def test_a_policy_other_than_timeout_by_default_is_replaced() -> None:
    """SGLang 0.5.23 defaults to timeout; were its default another, launch would add the flag."""
    got = decide(_values(hicache_storage_prefetch_policy="best_effort"), set(), {},
                 Recompute(None, "t", 16384, "t"), 30.0)
    assert got.argv == ["--hicache-storage-prefetch-policy", "timeout"] and got.extra


# ------------------------------------------------------------------ launch --dry-run


def test_cpu_gets_the_cap_line_in_the_extra_config(capsys, tmp_path: Path) -> None:
    out = dry_run(capsys, write(tmp_path, CPU), root=str(HOSTS / "cpu-box"))
    assert "--hicache-storage-prefetch-policy" not in out["argv"]       # SGLang's timeout
    extra = _extra(out)
    assert extra["prefetch_timeout_base"] == 0.0
    assert extra["prefetch_timeout_per_ki_token"] == pytest.approx(30.0 * 1024 / 16384)
    assert out["device"]["extra_config"] == {k: extra[k] for k in (
        "prefetch_timeout_base", "prefetch_timeout_per_ki_token")}
    why = _prefetch_reason(out)
    assert "nor past 30 s (offload.worth_it.max_prefetch_wait_s) at the 16,384-token context" in why
    assert "prefill speed unknown" in why and "a stalled tier costs at most that" in why


def test_a_configured_prefill_speed_and_cap_set_the_line(capsys, tmp_path: Path) -> None:
    cfg = CPU + "  worth_it: {prefill_tokens_per_s: 4096, max_prefetch_wait_s: 10}\n"
    out = dry_run(capsys, write(tmp_path, cfg), root=str(HOSTS / "cpu-box"))
    assert _extra(out)["prefetch_timeout_per_ki_token"] == pytest.approx(0.25)  # 1024 / 4096
    assert "prefill 4,096 tokens/s (configured" in _prefetch_reason(out)
    slow = CPU + "  worth_it: {prefill_tokens_per_s: 100, max_prefetch_wait_s: 5}\n"
    out = dry_run(capsys, write(tmp_path, slow), root=str(HOSTS / "cpu-box"))
    assert _extra(out)["prefetch_timeout_per_ki_token"] == pytest.approx(5 * 1024 / 16384)
    assert "the cap sets the slope" in _prefetch_reason(out)


def test_a_gpu_waits_as_long_as_the_plan_estimate_of_recomputing(capsys, tmp_path: Path) -> None:
    out = dry_run(capsys, write(tmp_path, GPU))                  # the dgx-8nvme fixture: H100s
    assert out["device"]["argv"] == []
    from offload.hicache.worth_it import estimate_prefill_tps

    tps, _ = estimate_prefill_tps("meta-llama/Llama-3.1-8B-Instruct", "H100", 1)
    per_ki = _extra(out)["prefetch_timeout_per_ki_token"]
    assert per_ki == pytest.approx(1024 / tps, rel=1e-4)
    assert sglang_wait_s(131072, PAGE, 0.0, per_ki) < 30.0       # SGLang's own: 33 s
    assert "estimated:" in _prefetch_reason(out)


def test_the_users_own_keys_win_in_the_composed_extra_config(capsys, tmp_path: Path) -> None:
    cfg = CPU.replace("  context-length: 16384\n", "  context-length: 16384\n  "
                      "hicache-storage-backend-extra-config: '{\"prefetch_timeout_base\": 2}'\n")
    out = dry_run(capsys, write(tmp_path, cfg), root=str(HOSTS / "cpu-box"))
    extra = _extra(out)
    assert extra["prefetch_timeout_base"] == 2
    assert extra["prefetch_timeout_per_ki_token"] == pytest.approx(30.0 * 1024 / 16384)


def test_wait_complete_in_the_config_is_kept(capsys, tmp_path: Path) -> None:
    cfg = CPU + "  worth_it: {max_prefetch_wait_s: 10}\n"
    out = dry_run(capsys, write(tmp_path, cfg), "--", "--hicache-storage-prefetch-policy",
                  "wait_complete", root=str(HOSTS / "cpu-box"))
    assert out["argv"][-2:] == ["--hicache-storage-prefetch-policy", "wait_complete"]
    assert "prefetch_timeout_base" not in _extra(out)
    assert "waits for ever on a stalled tier" in _prefetch_reason(out)


def test_an_unknown_context_is_assumed_and_said(capsys, tmp_path: Path) -> None:
    out = dry_run(capsys, write(tmp_path, CPU.replace("  context-length: 16384\n", "")),
                  root=str(HOSTS / "cpu-box"))
    assert _extra(out)["prefetch_timeout_per_ki_token"] == pytest.approx(
        30.0 * 1024 / ASSUMED_CONTEXT)
    assert "a longer prompt would wait past the cap" in _prefetch_reason(out)


@pytest.mark.parametrize("bad", ["0", "-1", "7200"])
def test_a_cap_out_of_range_is_refused(capsys, tmp_path: Path, bad: str) -> None:
    cfg = write(tmp_path, CPU + f"  worth_it: {{max_prefetch_wait_s: {bad}}}\n")
    rc, _out, err = run_cli(capsys, "launch", "--config", str(cfg), "--dry-run", "--root",
                            str(HOSTS / "cpu-box"))
    assert rc == 2
    assert any(f"offload.worth_it.max_prefetch_wait_s: {float(bad)!r} must be > 0 and at most "
               "3600" in line for line in err), err


def test_the_device_choice_carries_the_wait_on_every_device() -> None:
    from offload.launch.device import choose

    rec = Recompute(None, "t", 16384, "context-length")
    for device in ("cpu", "cuda", None):
        values = _values(device=device)
        wait = decide(values, set(), {}, rec, 30.0)
        got = choose(values, set(), wait)
        assert got.extra_config == wait.extra and wait.reason in got.reasons
        assert "--hicache-storage-prefetch-policy" not in got.argv      # SGLang's default stays


def test_a_key_of_the_extra_config_that_is_no_number_is_refused(capsys, tmp_path: Path) -> None:
    cfg = CPU.replace("  context-length: 16384\n", "  context-length: 16384\n  "
                      "hicache-storage-backend-extra-config: '{\"prefetch_timeout_per_ki_token\": "
                      "\"fast\"}'\n")
    rc, _out, err = run_cli(capsys, "launch", "--config", str(write(tmp_path, cfg)), "--dry-run",
                            "--root", str(HOSTS / "cpu-box"))
    assert rc == 2 and any("sglang.hicache-storage-backend-extra-config.prefetch_timeout_per_ki_"
                           "token: 'fast' is not a number of seconds" in line for line in err), err


def test_the_composed_wait_never_passes_the_line() -> None:
    """The figure in the extra config is rounded down, never up past the cap."""
    rec = Recompute(None, "t", 3 * 7 * 1024 + 1, "t")
    got = decide(_values(), set(), {}, rec, 29.0)
    assert sglang_wait_s(rec.context, PAGE, 0.0, got.extra["prefetch_timeout_per_ki_token"]) <= 29.0
