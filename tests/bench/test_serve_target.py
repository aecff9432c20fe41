"""`bench serve`'s L3 target (offload.bench.serve_target): the verdict's arithmetic, fresh triple
prompts, a raw read timed on a real file, the wheel's patch record, each hit's agreement with its
cold reply at the logprob, the run's spread beside the tolerance, why a target was missed, and
the table that prints them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from offload.agree import TOLERANCE, Answer
from offload.bench.serve import _print, _prompt, _summary
from offload.bench.serve_target import (
    agreement,
    has_patch,
    raw_read_s,
    spread,
    triple_prompts,
    verdict,
    why_missed,
)
from offload.launch.server import Reply


def reply(ids: list[int], lps: list[float], cached: int = 0) -> Reply:
    return Reply(text="", output_ids=ids, prompt_tokens=512, cached_tokens=cached, details={},
                 ttft_s=0.1, total_s=0.2,
                 answer=Answer(ids, lps, [{i: lp} for i, lp in zip(ids, lps)]))


def test_the_limit_is_l1l2_plus_twice_the_raw_read_plus_30_ms() -> None:
    v = verdict(l1l2_s=0.5, l3_s=0.6, raw_s=0.02)
    assert v["limit_s"] == pytest.approx(0.57) and v["met"] is False
    assert v["l3_extra_s"] == pytest.approx(0.1)
    assert verdict(0.5, 0.569, 0.02)["met"] is True


def test_triple_prompts_are_fresh_and_repeatable() -> None:
    first = triple_prompts(256, 7, 3)
    assert first == triple_prompts(256, 7, 3)
    assert len(first) == 3 and all(len(p) == 256 for p in first)
    before = [_prompt(256, 7 + 7919 * k) for k in range(3)]     # what bench serve sent first
    assert not any(p in before for p in first) and len({tuple(p) for p in first}) == 3


def test_a_raw_read_is_timed_on_the_directory(tmp_path: Path) -> None:
    assert raw_read_s(str(tmp_path), 5 << 20) > 0
    assert list(tmp_path.iterdir()) == []     # its scratch file is gone


def test_the_installed_wheel_records_patch_0008() -> None:
    assert has_patch("0008-") is True
    assert has_patch("9999-") is False


def test_a_deployment_without_local_weights_says_why(tmp_path: Path) -> None:
    from offload.bench.serve_target import missing_for_serve

    repo_id = tmp_path / "deploy.yaml"
    repo_id.write_text("sglang: {model-path: example-org/not-cached-anywhere}\n")
    assert "neither a local directory nor in the Hugging Face cache" in missing_for_serve(
        str(repo_id))
    local = tmp_path / "local.yaml"
    local.write_text(f"sglang: {{model-path: {tmp_path}}}\n")
    assert missing_for_serve(str(local)) is None
    assert "no sglang.model-path" in missing_for_serve(str(tmp_path / "absent.yaml"))


def test_a_private_server_is_started_from_a_loopback_copy_of_the_deployment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`private_server` (scripts/l3_profile.py, scripts/prefetch_policy.py) once imported a
    helper of `bench serve` that had been renamed; only the server start is stubbed here."""
    from offload.bench import serve_target
    from offload.launch.server import LaunchedServer

    started: list[tuple[Path, Path, str]] = []
    monkeypatch.setattr(LaunchedServer, "start", classmethod(
        lambda cls, config, log, url: started.append((Path(config), Path(log), url))))
    src = tmp_path / "deploy.yaml"
    src.write_text("sglang: {model-path: /models/x, port: 30000}\n")
    serve_target.private_server(str(src), tmp_path)
    ((config, log, url),) = started
    doc = yaml.safe_load(config.read_text())
    assert doc["sglang"]["host"] == "127.0.0.1" and url == f"http://127.0.0.1:{doc['sglang']['port']}"
    assert doc["offload"]["store"]["path"] == str(tmp_path / "store")
    assert log == tmp_path / "server.log"


def test_the_benchs_copy_of_a_deployment_loads_under_launchs_strict_rules(tmp_path: Path) -> None:
    """The copy a bench starts its servers from keeps the file's secrets, so it is private, and
    names one store directory (a file listing `paths` would become path + paths, refused)."""
    from offload.bench.serve import deployment
    from offload.config import load_file

    src = tmp_path / "deploy.yaml"
    src.write_text("sglang: {model-path: /models/x, admin-api-key: 0123456789abcdef}\n"
                   "offload: {store: {paths: [/d1/a, /d2/a], salt: tenant-salt-0123}}\n")
    src.chmod(0o600)
    out = deployment(str(src), tmp_path / "store", 4321, {"api-key": "fedcba9876543210"})
    assert out.stat().st_mode & 0o077 == 0
    cfg = load_file(out)
    assert cfg.offload.store.directories() == [str(tmp_path / "store")]
    assert cfg.offload.store.salt == "tenant-salt-0123"


def test_each_hit_is_judged_against_its_prompts_cold_reply_at_the_logprob() -> None:
    cold = [reply([1, 2], [-0.5, -1.0]), reply([3, 4], [-0.2, -0.3])]
    near = [reply([1, 2], [-0.5, -1.0 + TOLERANCE / 2], 448), reply([3, 4], [-0.2, -0.3], 448)]
    got = _summary(near, cold)
    ag = got["agreement"]
    assert ag["verdict"] == "same" and got["same_output"] is True and "why" not in ag
    assert ag["max_delta"] == pytest.approx(TOLERANCE / 2) and ag["topk_mismatches"] == 0
    assert len(ag["tries"]) == 2 and ag["tolerance"] == TOLERANCE
    # the same tokens with a logprob moved past the tolerance: a wrong KV, not a tie
    far = [reply([1, 2], [-0.5, -1.0 - 3 * TOLERANCE]), reply([3, 4], [-0.2, -0.3])]
    bad = _summary(far, cold)
    assert bad["agreement"]["verdict"] == "different" and bad["same_output"] is False
    assert bad["agreement"]["why"][0].startswith("different: max |delta logprob|")
    assert agreement(far[1:], cold[1:])["verdict"] == "same"


def test_the_runs_own_spread_is_reported_beside_the_tolerance() -> None:
    row = lambda d: {"agreement": {"max_delta": d}}     # noqa: E731
    rows = {"512": {"cold": {}, "l1l2": row(0.01), "l3": row(0.02), "l1l2_restarted": row(0.03)},
            "1024": {"cold": {}, "l1l2": row(0.005)}}
    sp = spread(rows)
    assert sp == {"l1l2_max_delta": 0.03, "l3_max_delta": 0.02, "tolerance": TOLERANCE}
    wide = spread({"512": {"l1l2": row(2 * TOLERANCE)}})
    assert "re-measure" in wide["note"] and wide["l3_max_delta"] is None


def test_a_missed_target_says_why_where_the_cause_is_known(tmp_path: Path) -> None:
    log = tmp_path / "server-2.log"
    log.write_text("x\n[t] offload: worth-it threshold 4,096 tokens (prefill 900 tokens/s measured, "
                   "load 0.250 s per hit + 1.00 GB/s)\n")
    missed = verdict(l1l2_s=0.10, l3_s=0.40, raw_s=0.01)
    row = {"target": missed, "l3": {"cached_details": {"storage": 0}},
           "cold_restarted": {"ttft_s": 0.9}}
    why = why_missed(row, 512, log)
    assert why and "recomputed, not loaded (0 of 512 tokens" in why
    assert "worth-it threshold 4,096 tokens" in why
    cheap = {**row, "l3": {"cached_details": {"storage": 448}}, "cold_restarted": {"ttft_s": 0.2}}
    why = why_missed(cheap, 512, tmp_path / "absent.log")
    assert why and "saves 100 ms of prefill" in why and "cannot beat a prefill this cheap" in why
    dear = {**cheap, "cold_restarted": {"ttft_s": 2.0}}      # a slow load: the cause is not known
    assert why_missed(dear, 512, log) is None
    assert why_missed({**row, "target": verdict(0.1, 0.1, 0.01)}, 512, log) is None


def test_the_table_shows_the_largest_delta_per_row_and_names_a_difference(
        capsys: pytest.CaptureFixture[str]) -> None:
    ag = lambda v, d: {"verdict": v, "max_delta": d, "topk_mismatches": 0}     # noqa: E731
    result = {"server": {}, "rows": {
        "512": {"cold": {"ttft_s": 1.0}, "l1l2": {"ttft_s": 0.5, "agreement": ag("same", 0.012)},
                "l3": {"ttft_s": 0.6, "agreement": ag("near-tie", 0.02)}},
        "1024": {"cold": {"ttft_s": 2.0}, "l1l2": {"ttft_s": 0.5, "agreement": ag("same", 0.01)},
                 "l3": {"ttft_s": 0.6, "agreement": {**ag("different", 1.5),
                                                     "why": ["different: max |delta| 1.5"]}}}},
        "spread": {"l1l2_max_delta": 0.012, "l3_max_delta": 1.5, "tolerance": TOLERANCE}}
    _print(result)
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.split()[:1] in (["512"], ["1024"])][:2]
    lines = {ln.split()[0]: ln for ln in rows}
    assert lines["512"].split()[-2:] == ["0.0200", "near-tie"]
    assert lines["1024"].split()[-2:] == ["1.5000", "DIFFERENT"]
    assert "largest |delta| vs L1/L2 0.0120 (this run's own spread), vs L3 1.5000" in out
    assert "1024 tokens, l3: different: max |delta| 1.5" in out


def test_the_benchs_servers_compute_the_lm_head_in_float32(tmp_path: Path) -> None:
    from offload.bench.serve import deployment

    src = tmp_path / "deploy.yaml"
    src.write_text("sglang: {model-path: /models/x, enable-fp32-lm-head: false}\n")
    doc = yaml.safe_load(deployment(str(src), tmp_path / "store", 4321).read_text())
    assert doc["sglang"]["enable-fp32-lm-head"] is True
