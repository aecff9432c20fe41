"""The README stays true and short: the set-up commands CI runs, every command; the generated
configuration reference in docs/ is current."""

from __future__ import annotations

from pathlib import Path

from offload.cli import COMMANDS
from offload.config import reference

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CONFIG_REFERENCE = ROOT / "docs" / "reference" / "config.md"
MAX_README_LINES = 300


def test_ci_runs_exactly_the_readme_commands():
    lines = [ln.strip() for ln in (ROOT / ".ci/run").read_text().splitlines()]
    cmds = [ln for ln in lines if ln and not ln.startswith(("#", "set ", "#!"))]
    assert cmds == ["bash scripts/install.sh", ".venv/bin/python -m pytest -q"]
    for c in cmds:
        assert f"```sh\n{c}\n```" in README


def test_every_command_is_in_the_readme():
    for name in COMMANDS:
        assert f"sglang-offload {name}" in README, name


def test_readme_is_short():
    n = len(README.splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move detail into docs/"


def test_config_reference_is_the_generated_one():
    text = CONFIG_REFERENCE.read_text()
    for key, tp, default, doc in reference():
        row = f"| `{key}` | {tp} | `{default}` | {doc} |"
        assert row in text, f"{CONFIG_REFERENCE.relative_to(ROOT)} is stale at {key}"
