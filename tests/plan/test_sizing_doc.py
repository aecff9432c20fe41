"""Every `$ sglang-offload plan ...` example in docs/design/sizing.md is the command's output."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from offload.cli import main

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "design" / "sizing.md"


def examples() -> list[tuple[list[str], list[str]]]:
    """(argv after `plan`, the lines shown) of each whole example (none elided with `...`)."""
    found = []
    for block in re.findall(r"```\n(.*?)```", PAGE.read_text(), re.S):
        lines = block.rstrip("\n").split("\n")
        if not lines[0].startswith("$ sglang-offload plan "):
            continue
        command = lines.pop(0)
        while command.endswith("\\"):
            command = command[:-1] + lines.pop(0)
        if not lines or any(line.strip() in ("...", "#   ...") for line in lines):
            continue                                       # a command alone, or elided
        found.append((shlex.split(command)[3:], lines))
    return found


def test_the_page_has_examples() -> None:
    assert len(examples()) >= 4


@pytest.mark.parametrize("argv, shown", examples(), ids=lambda x: " ".join(x)[:70]
                         if x and x[0].startswith("--") else "shown")
def test_an_example_is_the_commands_output(argv: list[str], shown: list[str], capsys,
                                           monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr().out.rstrip("\n").split("\n")
    if "assumptions:" not in shown:                        # the page may stop before them
        out = out[:out.index("assumptions:")]
        while out and not out[-1].strip():
            out.pop()
    assert shown == out
