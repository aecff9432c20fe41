"""Shared by tests/launch: run the real `sglang-offload` CLI in-process and collect its output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from offload import cli

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
HOSTS = REPO / "tests" / "fixtures" / "hosts"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, list[str]]:
    """(exit code, stdout, stderr lines) of `sglang-offload ARGV` run in this process."""
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, [ln for ln in err.splitlines() if ln.strip()]


def dry_run(capsys: pytest.CaptureFixture[str], config: Path | str, *extra: str,
            root: str = "/") -> dict[str, Any]:
    rc, out, err = run_cli(capsys, "launch", "--config", str(config), "--dry-run", "--json",
                           "--root", root, *extra)
    assert rc == 0, err
    return json.loads(out)


def write(tmp_path: Path, text: str, name: str = "deploy.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def fake_python(path: Path, body: str) -> Path:
    """A stand-in interpreter at PATH: it answers launch's interpreter probe (`-c`) with the pins,
    and runs the shell BODY for any other command line (SGLang's start)."""
    from offload.launch.interpreter import pinned

    probe = json.dumps({"sglang": {"found": True, "version": pinned()[0]},
                        "offload": {"found": True, "version": pinned()[1]}})
    path.write_text(f"#!/bin/sh\n[ \"$1\" = -c ] && echo '{probe}' && exit 0\n{body}")
    path.chmod(0o755)
    return path
