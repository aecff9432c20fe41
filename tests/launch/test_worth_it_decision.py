"""`launch` names the worth-it threshold the backend will apply on its device, and why."""

from __future__ import annotations

from pathlib import Path

from tests.launch.helpers import HOSTS, dry_run, write

CPU = "sglang:\n  model-path: m\n  device: cpu\n  page-size: 64\noffload:\n  store: {path: /tmp/x}\n"


def test_cpu_measures_the_prefill_speed(capsys, tmp_path: Path) -> None:
    out = dry_run(capsys, write(tmp_path, CPU), root=str(HOSTS / "cpu-box"))
    text = out["worth_it"]
    assert "on device cpu no preset applies" in text and "measured from the first requests" in text
    assert "break-even" in text


def test_a_configured_prefill_speed_or_the_rule_off_is_named(capsys, tmp_path: Path) -> None:
    set_tps = CPU + "  worth_it: {prefill_tokens_per_s: 1500}\n"
    assert "1,500 tokens/s (configured)" in dry_run(
        capsys, write(tmp_path, set_tps), root=str(HOSTS / "cpu-box"))["worth_it"]
    off = CPU + "  worth_it: {enabled: false}\n"
    assert "rule off" in dry_run(capsys, write(tmp_path, off),
                                 root=str(HOSTS / "cpu-box"))["worth_it"]
