"""`bench store`: a small real run leaves its directory as it found it, warns about nothing of its
own making, and its progress bar names the step under way."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from offload.cli import main


def test_small_run_is_clean_and_names_its_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    rc = main(["bench", "store", "--sizes", "64KiB,128KiB", "--total", "512KiB", "--repeat", "1",
               "--lookup-blocks", "2000", "--dir", str(tmp_path), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0
    result = json.loads(out)
    assert [r["block_bytes"] for r in result["sizes"]] == [64 << 10, 128 << 10]
    assert result["index"]["blocks"] == 2000
    assert list(tmp_path.iterdir()) == []                     # everything it wrote is gone
    assert caplog.records == [], caplog.text                  # no chmod warning of its own dirs
    for step in ("raw disk", "64KiB blocks, try 1/1", "128KiB blocks, try 1/1",
                 "index of 2,000 entries"):
        assert f"bench store: {step}" in err


def test_help_shows_plot_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "store", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--plot OUT.png" in out and "(default: 256MiB)" in out and "(default: 100000)" in out
