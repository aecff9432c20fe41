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
# A fixture machine with 8 GPUs on which detection picks the cpu path: where the tests dry-run a
# GPU deployment (this CPU box has no GPU: a dry run of tp-size 8 here is refused).
GPU_HOST = str(HOSTS / "dgx-8nvme")


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, list[str]]:
    """(exit code, stdout, stderr lines) of `sglang-offload ARGV` run in this process."""
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, [ln for ln in err.splitlines() if ln.strip()]


def dry_run(capsys: pytest.CaptureFixture[str], config: Path | str, *extra: str,
            root: str = GPU_HOST) -> dict[str, Any]:
    rc, out, err = run_cli(capsys, "launch", "--config", str(config), "--dry-run", "--json",
                           "--root", root, *extra)
    assert rc == 0, err
    return json.loads(out)


def write(tmp_path: Path, text: str, name: str = "deploy.yaml", mode: int = 0o600) -> Path:
    """A deployment file, private by default (one holding a secret must be: load_file)."""
    p = tmp_path / name
    p.write_text(text)
    p.chmod(mode)
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
