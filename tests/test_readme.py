"""The README stays true: the set-up commands CI runs, every command, every setting."""

from __future__ import annotations

from pathlib import Path

from offload.cli import COMMANDS
from offload.config import reference

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_ci_runs_exactly_the_readme_commands():
    lines = [ln.strip() for ln in (ROOT / ".ci/run").read_text().splitlines()]
    cmds = [ln for ln in lines if ln and not ln.startswith(("#", "set ", "#!"))]
    assert cmds == ["bash scripts/install.sh", ".venv/bin/python -m pytest -q"]
    for c in cmds:
        assert f"```sh\n{c}\n```" in README


def test_every_command_is_documented_with_an_example():
    for name in COMMANDS:
        assert f"sglang-offload {name}" in README, name


def test_config_reference_is_the_generated_one():
    for key, tp, default, doc in reference():
        row = f"| `{key}` | {tp} | `{default}` | {doc} |"
        assert row in README, f"README's configuration reference is stale at {key}"
