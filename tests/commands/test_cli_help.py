"""Every command answers --help (argparse help strings are %-formatted: a stray % crashes it)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from offload.cli import COMMANDS, main
from offload.commands import agent

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_of_every_command(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([name, "--help"]) == 0
    assert "usage: sglang-offload" in capsys.readouterr().out


def _table_defaults(page: str, section: str) -> dict[str, str]:
    """`| `--flag ...` | default | meaning |` rows of one `## section` of a reference page."""
    text = page.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(--[a-z-]+)[^`]*` \| ([^|]*) \|", text, re.M)
    return {flag: default.strip() for flag, default in rows}


def test_agent_help_shows_every_default_of_the_reference(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The defaults docs/reference/cli.md lists for `agent` are the ones `agent --help` prints."""
    defaults = _table_defaults((ROOT / "docs/reference/cli.md").read_text(), "agent")
    shown = {k: v for k, v in defaults.items()
             if v and not v.startswith(("(", "`"))}           # (required), $ENVIRONMENT
    assert {"--max-clients", "--io-timeout", "--transport"} <= set(shown)
    p = argparse.ArgumentParser()
    agent.add_arguments(p)
    helps = {a.option_strings[0]: a.help or "" for a in p._actions if a.option_strings}
    for flag, default in shown.items():
        assert re.search(f"default {re.escape(default)}[;)]", helps[flag]), (flag, helps[flag])
    assert main(["agent", "--help"]) == 0                     # and argparse prints them
    assert "(default 1024)" in " ".join(capsys.readouterr().out.split())
