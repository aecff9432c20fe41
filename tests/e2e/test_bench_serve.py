"""`sglang-offload bench serve`: its options are checked before any work, its plot draws, and a
real run (two server starts through launch) reports an L3 hit agreeing with the cold reply at the
logprob (offload.agree)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offload import cli
from offload.agree import RANDOM_TOLERANCE, tolerance_for
from tests.e2e.conftest import deployment, full_pages


@pytest.mark.parametrize("argv,expected", [
    ([], "error: give one of --config FILE (start a server) or --url URL (a running one)"),
    (["--url", "http://127.0.0.1:1", "--lengths", "64"], "64 tokens: use at least 128"),
    (["--url", "http://127.0.0.1:1", "--phases", "cold,warm"], "unknown 'warm'"),
])
def test_bad_options_are_one_error_line(argv: list[str], expected: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "serve", *argv]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_a_real_run_reports_cold_l1l2_and_l3(tmp_path: Path, demo_model: Path) -> None:
    cfg = deployment(tmp_path / "deploy.yaml", demo_model, 0, tmp_path / "ignored")
    res = subprocess.run([sys.executable, "-m", "offload.cli", "bench", "serve", "--config",
                          str(cfg), "--lengths", "512", "--repeat", "1", "--dir", str(tmp_path),
                          "--json"],
                         capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "UCX_MODULES": "^ib"})
    assert res.returncode == 0, res.stderr[-4000:]
    out = res.stdout
    result = json.loads(out[out.index("{\n"):])
    row = result["rows"]["512"]
    assert row["cold"]["cached_tokens"] == 0
    assert row["l1l2"]["cached_tokens"] == full_pages(512) and row["l1l2"]["same_output"]
    assert row["l3"]["cached_tokens"] == full_pages(512) and row["l3"]["same_output"]
    # each hit against the cold reply at the logprob, within the measured tolerance (the random
    # demo model's: it measured no spread at all)
    TOLERANCE = tolerance_for(demo_model)
    assert TOLERANCE == RANDOM_TOLERANCE
    for phase in ("l1l2", "l3", "l1l2_restarted"):
        ag = row[phase]["agreement"]
        assert ag["verdict"] != "different" and ag["max_delta"] <= TOLERANCE, (phase, ag)
        assert ag["tolerance"] == TOLERANCE and len(ag["tries"]) == 1
    spread = result["spread"]
    assert spread["tolerance"] == TOLERANCE and "note" not in spread
    assert spread["l1l2_max_delta"] == max(row[p]["agreement"]["max_delta"]
                                           for p in ("l1l2", "l1l2_restarted"))
    assert "largest |delta| vs L1/L2" in out and "max |d|" in out
    assert row["l3"]["cached_details"]["storage"] == full_pages(512)
    assert result["server"]["attention_backend"] == "torch_native"
    assert "note" not in result      # the wheel has patches/0008: no note about recomputation
    # the restarted server's triple: a fresh prompt cold, the L3 hit, the same again from L1/L2
    assert row["cold_restarted"]["cached_tokens"] == 0
    assert row["l1l2_restarted"]["cached_tokens"] == full_pages(512)
    assert row["l1l2_restarted"]["same_output"]
    assert len(row["raw_read_s_tries"]) == 1 and row["raw_read_s_tries"][0] > 0
    target = row["target"]
    assert target["limit_s"] == pytest.approx(target["l1l2_s"] + 2 * target["raw_read_s"] + 0.03,
                                              abs=2e-4)
    assert "L3 target at 512 tokens" in out
    assert result["store"]["blocks"] >= full_pages(512) // 64
    assert "bench serve:" in out
    # SGLang's page-hash extension was ready before each server answered: no request built it
    assert len(result["native_hash_at_start"]) == 2
    assert all(" hicache_hash_cpp " in line and " loaded in " in line
               for line in result["native_hash_at_start"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deploy.yaml"]   # its scratch is gone


@pytest.mark.parametrize("offload", ["[1]", "{store: [1]}"])
def test_an_offload_section_that_is_not_a_mapping_is_one_error_line(
        offload: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text(f"sglang: {{model-path: /nonexistent}}\noffload: {offload}\n")
    rc = cli.main(["bench", "serve", "--config", str(cfg), "--dir", str(tmp_path), "--lengths", "128"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "offload: and offload.store: must be mappings" in err and "Traceback" not in err
