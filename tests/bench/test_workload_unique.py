"""`bench workload --unique` without a server: SGLang's client builds prompts of which no two
share a first page (its own parser and generator, the demo model's tokenizer, stopped before
it sends), our reproduction of them is what it builds, and the report's ratios and targets."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest

from offload import cli
from offload.bench.workload import client as wc
from offload.bench.workload import unique as wu
from offload.bench.workload.report import print_result

PAGE = 64


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from offload.demo import DemoSpec, write_demo

    out = tmp_path_factory.mktemp("demo-model")
    write_demo(out, DemoSpec())
    return out


def _w(**kw: Any) -> wc.Workload:
    base = dict(groups=3, users=4, turns=2, prefix=PAGE * 4, question=32, output=4,
                concurrency=2, seed=13, unique=True)
    return wc.Workload(**{**base, **kw})  # type: ignore[arg-type]


def _client_rows(argv: list[str], model: Path, home: Path,
                 monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """What SGLang's client would send for `argv`: its own parser and checks, then, seeded as
    its run_benchmark seeds, its dataset; stopped there (no server)."""
    import numpy as np
    from sglang.benchmark import serving
    from sglang.benchmark.datasets import get_dataset
    from sglang.benchmark.utils import get_tokenizer

    got: list[Any] = []

    def build(args: Any) -> None:           # run_benchmark's first steps, short of the server
        random.seed(args.seed)
        np.random.seed(args.seed)
        got.extend(get_dataset(args, get_tokenizer(str(model))))

    monkeypatch.setenv("HOME", str(home))   # its prompt cache, as run_client puts it
    monkeypatch.setattr(serving, "run_benchmark", build)
    monkeypatch.setattr(sys, "argv", ["serving", *argv[3:]])
    serving.cli_main()
    return [list(r.prompt) for r in got]


def test_no_two_prompts_share_a_first_page_and_the_client_sends_what_we_check(
        demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = _w()
    argv = wc.client_argv("http://127.0.0.1:4321", w, tmp_path / "run.jsonl")
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags["--backend"] == "sglang" and "--tokenize-prompt" in argv   # ids, no template
    assert flags["--gsp-num-groups"] == flags["--num-prompts"] == str(w.requests) == "24"
    assert flags["--gsp-prompts-per-group"] == flags["--gsp-num-turns"] == "1"
    ours = wu.prompts(str(demo_model), w, tmp_path)
    assert len(ours) == 24 and {len(p) for p in ours} == {w.prefix + w.question}
    assert wu.shared_first_pages(ours, PAGE) == 0
    sent = _client_rows(argv, demo_model, tmp_path, monkeypatch)
    assert sorted(sent) == sorted(ours)            # the client's own, shuffled


def test_the_standard_run_is_unchanged() -> None:
    argv = wc.client_argv("http://127.0.0.1:4321", _w(unique=False), Path("/x.jsonl"))
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags["--backend"] == "sglang-oai-chat" and "--tokenize-prompt" not in argv
    assert flags["--gsp-num-groups"] == "3" and flags["--gsp-num-turns"] == "2"


def test_shared_first_pages_counts_pairs() -> None:
    a, b = [1] * PAGE + [2], [1] * PAGE + [3]
    assert wu.shared_first_pages([a, b, list(a)], PAGE) == 3
    assert wu.shared_first_pages([a, [9] + a[1:]], PAGE) == 0
    assert wu.shared_first_pages([[1] * 10, [1] * 10], PAGE) == 0    # no whole page to share


def _run(tier: str, rnd: int, mean: float, rps: float, tps: float, nbytes: int) -> dict[str, Any]:
    return {"tier": tier, "round": rnd, "requests": 24, "failed": 0, "first_request_s": 0.1,
            "ttft_ms": {"mean": mean, "p50": mean, "p90": mean * 1.5},
            "throughput": {"requests_per_s": rps, "input_tokens_per_s": tps - 10,
                           "output_tokens_per_s": 10.0, "tokens_per_s": tps},
            "cached_tokens": 0, "prompt_tokens": 6912, "hit_rate": 0.0,
            "l3": {"blocks": nbytes // 131072, "bytes": nbytes, "bytes_written_metric": None,
                   "settle_s": 0.0}}


def test_ratios_are_per_round_against_no_l3_and_the_targets_judge_their_median() -> None:
    runs = [_run("none", 0, 100.0, 2.0, 1000.0, 0), _run("ours", 0, 104.0, 1.96, 980.0, 3 << 20),
            _run("none", 1, 200.0, 1.0, 500.0, 0), _run("ours", 1, 220.0, 0.9, 450.0, 3 << 20),
            _run("none", 2, 100.0, 2.0, 1000.0, 0), _run("ours", 2, 100.0, 2.0, 1000.0, 3 << 20)]
    r = wu.ratios(runs, ["none", "ours"])["ours/none"]
    assert [x["ttft_mean"] for x in r["rounds"]] == [1.04, 1.1, 1.0]
    assert r["median"]["ttft_mean"] == 1.04 and r["median"]["requests_per_s"] == 0.98
    assert r["median"]["ttft_p90"] == 1.04
    assert r["targets"] == {"requests_per_s": {"at_least": 0.97, "met": True},
                            "tokens_per_s": {"at_least": 0.97, "met": True},
                            "ttft_mean": {"at_most": 1.05, "met": True}}
    slow = wu.ratios([_run("none", 0, 100.0, 2.0, 1000.0, 0),
                      _run("ours", 0, 106.0, 1.9, 950.0, 1)], ["none", "ours"])["ours/none"]
    assert not any(t["met"] for t in slow["targets"].values())
    failed = _run("ours", 0, 0.0, 0.0, 0.0, 0)       # no figure: a target missed, not a pass
    failed["ttft_ms"] = {"mean": None, "p50": None, "p90": None}
    miss = wu.ratios([_run("none", 0, 100.0, 2.0, 1000.0, 0), failed], ["none", "ours"])
    assert miss["ours/none"]["median"]["ttft_mean"] is None
    assert not miss["ours/none"]["targets"]["ttft_mean"]["met"]


def test_the_report_prints_the_ratios_targets_and_bytes(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    from offload.bench.common import median_of

    runs = [_run("none", 0, 100.0, 2.0, 1000.0, 0), _run("ours", 0, 104.0, 1.9, 980.0, 50_000_000),
            _run("none", 1, 100.0, 2.0, 1000.0, 0), _run("ours", 1, 100.0, 2.0, 1000.0, 50_000_000)]
    keys = ("requests", "failed", "ttft_ms", "throughput", "cached_tokens", "prompt_tokens",
            "hit_rate", "l3")
    result = {"mode": "unique", "client": wc.CLIENT, "tiers": ["none", "ours"],
              "workload": {**_w().__dict__, "requests": 24}, "server": {"page_size": PAGE},
              "first_pages": {"page": PAGE, "prompts": 24, "shared_pairs": 0},
              "runs": runs, "ratios": wu.ratios(runs, ["none", "ours"]),
              "summary": {t: median_of([{k: r[k] for k in keys} for r in runs if r["tier"] == t])
                          for t in ("none", "ours")}}
    print_result(result)
    out = capsys.readouterr().out
    assert "24 prompts of 288 tokens, each its own" in out
    assert "no prefix repeats: 0 pairs of 24 prompts share a first page of 64 tokens" in out
    assert "ours/none (median of 2 rounds" in out
    assert "req/s 0.975x (target >= 0.97x: met)" in out
    assert "TTFT mean 1.020x (target <= 1.05x: met)" in out
    assert "ours wrote 50.0 MB to its L3" in out
    assert out.count("median") >= 3                   # a median row per tier, and the ratios


def test_ours_bytes_written_are_read_from_the_metrics() -> None:
    text = ('sglang_offload_bytes_total{direction="write",tier="local"} 262144.0\n'
            'sglang_offload_bytes_total{direction="read",tier="local"} 9.0\n'
            'sglang_offload_bytes_total{direction="write",tier="redis"} 131072.0\n')
    assert wu._bytes_metric(text) == 393216
    assert wu._bytes_metric("sglang:num_requests_total 3\n") is None


@pytest.mark.parametrize("argv,expected", [
    (["--unique", "--tiers", "ours"], "--unique --tiers ours: each L3 is measured against no L3"),
    (["--unique", "--tiers", "none"], "give none and at least one L3"),
    (["--unique", "--cold-restart"], "--unique is a run of its own"),
    (["--unique", "--sweep-users", "1,2", "--ttft-target-ms", "5"], "--unique is a run of its"),
])
def test_bad_unique_options_are_one_error_line(argv: list[str], expected: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text("sglang: {model-path: /nonexistent}\n")
    assert cli.main(["bench", "workload", "--config", str(cfg), *argv]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
