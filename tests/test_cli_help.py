"""Every command answers --help (argparse help strings are %-formatted: a stray % crashes it)."""

from __future__ import annotations

import pytest

from offload.cli import COMMANDS, main


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_of_every_command(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([name, "--help"]) == 0
    assert "usage: sglang-offload" in capsys.readouterr().out
