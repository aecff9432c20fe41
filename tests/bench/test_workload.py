"""`bench workload` without a server: its options, the tiers' command lines, SGLang's client
(installed by the set-up, offline), agreement, a differing turn judged at the logprob, and why a
missed target was missed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from offload import cli
from offload.agree import TOLERANCE, Answer
from offload.bench.workload import client as wc
from offload.bench.workload.margin import messages, parting
from offload.bench.workload.tiers import swap_backend

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BENCH_DEPS = REPO / "distro" / "sglang-bench-deps.txt"


@pytest.mark.parametrize("argv,expected", [
    ([], "the following arguments are required: --config"),
    (["--config", "{cfg}", "--tiers", "none,l3"], "unknown 'l3'"),
    (["--config", "{cfg}", "--l2-ratio", "1"], "must be more than 1"),
    (["--config", "{cfg}", "--sweep-users", "4,2"], "must be ascending"),
    (["--config", "{cfg}", "--sweep-users", "1,2"], "--sweep-users needs --ttft-target-ms"),
    (["--config", "{cfg}", "--ttft-target-ms", "500"], "--ttft-target-ms is the target of"),
    (["--config", "{cfg}", "--sweep-users", "1,2", "--ttft-target-ms", "500", "--cold-restart"],
     "--cold-restart is for the restart run"),
    (["--config", "{cfg}", "--tiers", "ours,ours"], "--tiers ours,ours: each tier once"),
    (["--config", "{tmp}/nope.yaml"], "--config {tmp}/nope.yaml: cannot read it"),
    (["--config", "{tmp}/list.yaml"], "expected a deployment file with a sglang: section"),
    (["--config", "{cfg}", "--turns", "0"], "argument --turns: '0': must be at least 1"),
    (["--config", "{cfg}", "--tie-margin", "0.1"], "--tie-margin is gone: a differing turn is "
     "now asked again with logprobs and judged at the logprob"),
])
def test_bad_options_are_one_error_line(argv: list[str], expected: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text("sglang: {model-path: /nonexistent}\n")
    (tmp_path / "list.yaml").write_text("- 1\n")
    argv = [a.format(cfg=cfg, tmp=tmp_path) for a in argv]
    assert cli.main(["bench", "workload", *argv]) == 2
    err = capsys.readouterr().err
    assert expected.format(tmp=tmp_path) in err and "Traceback" not in err
    assert "error: " in err


def test_the_scratch_directory_is_removed_unless_kept(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """--keep leaves each phase's client results and logs in place (a request-by-request
    comparison of two runs needs them) and names the directory; without it nothing is left."""
    from offload.bench.common import scratch

    with scratch(str(tmp_path), "bench-workload-") as root:
        (Path(root) / "after.jsonl").write_text("{}\n")
    assert list(tmp_path.iterdir()) == []
    with scratch(str(tmp_path), "bench-workload-", keep=True) as root:
        (Path(root) / "after.jsonl").write_text("{}\n")
    assert (Path(root) / "after.jsonl").read_text() == "{}\n"
    assert f"keeping {root}" in capsys.readouterr().err


def test_the_tiers_differ_only_in_the_storage_backend(tmp_path: Path) -> None:
    argv = ["python", "-m", "sglang.launch_server", "--model-path", "m", "--page-size", "64",
            "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config",
            '{"backend_name": "offload"}', "--attention-backend", "torch_native"]
    rest = ["python", "-m", "sglang.launch_server", "--model-path", "m", "--page-size", "64",
            "--attention-backend", "torch_native"]
    assert swap_backend(argv, "none", tmp_path) == rest
    got = swap_backend(argv, "file", tmp_path, {"prefetch_threshold": 64})
    assert got[:len(rest)] == rest
    assert got[len(rest):len(rest) + 3] == ["--hicache-storage-backend", "file",
                                            "--hicache-storage-backend-extra-config"]
    assert json.loads(got[-1]) == {"prefetch_threshold": 64, "file_storage_path": str(tmp_path)}


def test_the_client_runs_sglangs_own_generated_shared_prefix_workload(tmp_path: Path) -> None:
    w = wc.Workload(groups=2, users=3, turns=4, prefix=512, question=32, output=4,
                    concurrency=2, seed=9)
    argv = wc.client_argv("http://127.0.0.1:4321", w, tmp_path / "out.jsonl")
    assert argv[1:3] == ["-m", "sglang.benchmark.serving"]
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags["--dataset-name"] == "generated-shared-prefix"
    assert flags["--backend"] == "sglang-oai-chat" and flags["--num-prompts"] == "6"
    assert flags["--gsp-num-turns"] == "4" and flags["--port"] == "4321"
    assert "--cache-report" in argv and "--output-details" in argv
    env = wc.client_env(tmp_path)
    assert env["HOME"] == str(tmp_path) and env["HF_HUB_OFFLINE"] == "1"


def _requirements(path: Path) -> list[str]:
    return [re.split(r"[=<>!~\[; ]", ln.split("#")[0].strip(), maxsplit=1)[0].lower()
            for ln in path.read_text().splitlines() if ln.split("#")[0].strip()]


def test_sglangs_client_starts_on_the_set_up_and_every_listed_package_is_used() -> None:
    """Enough: `python -m sglang.benchmark.serving --help` runs (it imports every dataset loader
    at start: MMMU's imports `datasets`). Minimal: the client imports every line of the list."""
    probe = ("import importlib.metadata as md, json, runpy, sys\n"
             "sys.argv = ['serving', '--help']\n"
             "try:\n    runpy.run_module('sglang.benchmark.serving', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "d = md.packages_distributions()\n"
             "print(json.dumps(sorted({x.lower() for m in list(sys.modules) "
             "for x in d.get(m.split('.')[0], [])})))\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600,
                       env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0 and "--gsp-num-turns" in r.stdout, r.stderr[-3000:]
    used = set(json.loads(r.stdout.strip().splitlines()[-1]))
    unused = [n for n in _requirements(BENCH_DEPS) if n not in used]
    assert not unused, f"listed but not imported by SGLang's client: {unused}"


def test_a_difference_counts_once_per_conversation_at_its_first_turn() -> None:
    ref = ["a", "b", "c", "d", "e", "f"]           # 3 conversations of 2 turns
    assert wc.disagreements(ref, list(ref), 2) == []
    assert wc.disagreements(ref, ["a", "B", "C", "D", "e", "f"], 2) == [(0, 1), (1, 0)]
    assert wc.disagreements(ref, ["a", "b", None, "d", "e", "f"], 2) == [(1, 0)]


class Letters:
    """A tokenizer of one letter per id (97: 'a')."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)


def test_the_margin_is_the_references_own_token_against_the_others_where_they_part() -> None:
    a, b, c, x = 97, 98, 99, 120
    ans = Answer([a, b, c], [-0.1, -0.70, -0.2],
                 [{a: -0.1, x: -3.0}, {b: -0.70, x: -0.72, c: -2.0}, {c: -0.2}])
    assert parting(Letters(), ans, "abc") == (None, None)          # spelt alike throughout
    pos, margin = parting(Letters(), ans, "axc")                    # parts at 1: a near-tie
    assert pos == 1 and margin == pytest.approx(0.02) and margin <= TOLERANCE
    pos, margin = parting(Letters(), ans, "ac")                     # 'c' at 1: 1.3 nats below
    assert pos == 1 and margin == pytest.approx(1.3)
    assert parting(Letters(), ans, "az") == (1, None)               # not in the top-k: real
    assert messages(["q0", "q1"], ["r0", "r1"], 1) == [
        {"role": "user", "content": "q0"}, {"role": "assistant", "content": "r0"},
        {"role": "user", "content": "q1"}]


def test_a_missed_target_says_why_where_the_cause_is_known(tmp_path: Path) -> None:
    from offload.bench.workload.restart import why_missed

    def summary(storage: int, none_ms: float) -> dict:
        return {"ours": {"after": {"cached_by_tier": {"storage": storage}}},
                "none": {"after": {"ttft_ms": {"mean": none_ms}}}}
    log = tmp_path / "server-2.log"
    log.write_text("[t] offload: worth-it threshold 2,048 tokens (prefill 1,200 tokens/s measured, "
                   "load 0.300 s per hit + 0.80 GB/s)\n")
    why = why_missed(summary(0, 900.0), [log, tmp_path / "absent.log"], 1024)
    assert why and "recomputed, not loaded (0 tokens from storage)" in why
    assert "break-even is 2,048 tokens" in why and "cannot beat a cheap prefill" in why
    why = why_missed(summary(4096, 500.0), [log], 4096)          # loaded, but 300 of 500 ms fixed
    assert why and "one load's fixed cost (300 ms per hit" in why and "500 ms" in why
    assert why_missed(summary(4096, 5000.0), [log], 4096) is None      # the cause is not known
    assert "served no tokens" in (why_missed(summary(0, 500.0), [], 4096) or "")


def test_the_agreement_line_reports_the_re_asks(capsys: pytest.CaptureFixture[str]) -> None:
    from offload.bench.workload.report import print_result

    diff = {"tier": "ours", "round": 0, "phase": "after", "conversation": 1, "turn": 0,
            "verdict": "different", "margin": 1.25, "first_diff": 3, "probe_reproduces": "reference"}
    result = {"mode": "restart", "workload": {"groups": 1, "prefix": 8, "users": 1, "turns": 1,
                                              "question": 1, "output": 1, "concurrency": 1,
                                              "seed": 1},
              "client": "c", "tiers": ["none", "ours"],
              "ratios": {"ours/none": {"after": {"mean": 0.9, "p50": 0.9, "p90": 0.9},
                                       "target": {"after_mean_at_most": 0.5, "met": False,
                                                  "why": "the prefill is cheap"}}},
              "agreement": {"requests": 8, "reference": "none before the restart",
                            "differing_conversations": 2, "near_ties": 1, "real_differences": 1,
                            "tolerance": TOLERANCE, "max_delta": 0.0312, "topk_mismatches": 2,
                            "measured_over": "the differing turns", "differences": [diff]}}
    print_result(result)
    out = capsys.readouterr().out
    assert "(target <= 0.5x: MISSED); why: the prefill is cheap" in out
    assert (f"1 near-ties: the reference's margin within the tolerance of {TOLERANCE} nats; 1 "
            "real differences); re-asked with logprobs: largest |delta logprob| 0.0312, 2 top-k "
            "mismatches (over the differing turns)") in out
    assert "DIFFERENT: ours round 1 after, conversation 1 turn 0: margin 1.2500 at token 3" in out


def test_a_summary_counts_cached_tokens_by_tier_and_skips_failures() -> None:
    result = {"errors": ["", "", "boom"], "ttfts": [0.1, 0.3, 9.0], "input_lens": [100, 200, 50],
              "cached_tokens": [64, 192, 0], "duration": 2.0, "request_throughput": 1.5,
              "cached_tokens_details": [{"device": 64, "host": 0, "storage": 0},
                                        {"device": 0, "host": 64, "storage": 128,
                                         "storage_backend": "OffloadStorage"}, None]}
    s = wc.summary(result)
    assert s["failed"] == 1 and s["requests"] == 3
    assert s["cached_by_tier"] == {"device": 64, "host": 64, "storage": 128}
    assert s["ttft_ms"] == {"mean": 200.0, "p50": 200.0, "p90": 280.0}
    assert s["hit_rate"] == round(256 / 300, 4) and s["storage_backend"] == "OffloadStorage"


def test_a_saved_result_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from offload.bench import plot

    cell = {"ttft_ms": {"mean": 3.0, "p50": 2.0, "p90": 4.0}}
    restart = {"mode": "restart", "workload": {}, "summary": {
        t: {"before": cell, "after": cell} for t in ("none", "file", "ours")}}
    sweep = {"mode": "sweep", "workload": {}, "sweep": {
        "ttft_target_ms": 5.0, "max_users": {"none": 1},
        "steps": {"none": [[{"users": 1, "ttft_ms": {"p90": 2.0}},
                            {"users": 2, "ttft_ms": {"p90": 6.0}}]]}}}
    unique = {"mode": "unique", "workload": {}, "summary": {t: cell for t in ("none", "ours")}}
    for name, result in (("restart", restart), ("sweep", sweep), ("unique", unique)):
        assert plot.kind_of(result) == "workload"
        out = tmp_path / f"{name}.png"
        assert plot.draw(result, str(out)) == str(out) and out.stat().st_size > 0


def test_storage_hits_sglang_did_not_load_are_read_from_its_metrics() -> None:
    from offload.bench.workload.tiers import not_loaded

    text = "\n".join([
        "# HELP sglang:storage_prefetch_unfulfilled_tokens_total Storage hits not loaded",
        "# TYPE sglang:storage_prefetch_unfulfilled_tokens_total counter",
        'sglang:storage_prefetch_unfulfilled_tokens_total{pp_rank="0",reason="host_capacity",'
        'tp_rank="0"} 4480.0',
        'sglang:storage_prefetch_unfulfilled_tokens_total{pp_rank="0",reason="host_capacity",'
        'tp_rank="1"} 64.0',
        'sglang:storage_prefetch_unfulfilled_tokens_total{pp_rank="0",reason="deadline",'
        'tp_rank="0"} 128.0',
        'sglang:storage_prefetch_hit_tokens_total{pp_rank="0",tp_rank="0"} 9999.0',
        'sglang:storage_prefetch_unfulfilled_tokens_total{reason="x"} not-a-number',
    ])
    assert not_loaded(text) == {"total": 4672, "host_capacity": 4544}
    assert not_loaded("") == {"total": 0, "host_capacity": 0}


def test_the_file_tier_waits_for_a_prefetch_as_ours_does(tmp_path: Path) -> None:
    """The `file` L3 gets launch's prefetch wait keys (SGLang's default deadline otherwise, while
    ours runs launch's), and a key the user set still wins."""
    from offload.bench.workload.tiers import tier_command
    from offload.launch.compose import prepare

    root = Path(__file__).resolve().parents[2]
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text((root / "configs" / "cpu-dev.yaml").read_text())
    ours = prepare(str(cfg)).device.extra_config
    assert ours and all(k.startswith("prefetch_timeout_") for k in ours)
    argv, env = tier_command("file", cfg, tmp_path / "l3")
    extra = json.loads(argv[argv.index("--hicache-storage-backend-extra-config") + 1])
    assert {k: extra[k] for k in ours} == ours and extra["file_storage_path"] == str(tmp_path / "l3")
    assert env == prepare(str(cfg)).device.env
