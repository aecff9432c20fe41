"""`bench contend`: a tiny real run (SGLang's factory, a real host pool, the raw drive) gives every
figure, leaves its directory as it found it, and is drawn by `--plot`; a bad page size is one
`error:` line. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offload.cli import main

pytestmark = pytest.mark.slow


def test_a_tiny_run_gives_every_figure_and_cleans_up(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    work = tmp_path / "work"
    work.mkdir()
    png = tmp_path / "contend.png"
    rc = main(["bench", "contend", "--dir", str(work), "--page-size", "256KiB",
               "--read-pages", "2", "--write-batch", "3", "--seconds", "0.2", "--json",
               "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    result = json.loads(out)
    for side in ("raw", "offload"):
        for phase in ("alone", "beside"):
            r = result[side][phase]
            assert r["reads"] >= 5 and 0 < r["p50_ms"] <= r["p90_ms"]
        assert result[side]["beside"]["writer_pages"] > 0
    assert result["offload"]["read_misses"] == 0
    t = result["target"]
    assert t["limit_ms"] == pytest.approx(2 * result["raw"]["beside"]["p90_ms"] + 20)
    assert t["met"] == (t["ours_p90_ms"] <= t["limit_ms"])
    assert list(work.iterdir()) == []                     # everything it wrote is gone
    assert png.stat().st_size > 0

    saved = tmp_path / "contend.json"
    saved.write_text(out)
    again = tmp_path / "again.png"
    assert main(["bench", "plot", str(saved), "--plot", str(again)]) == 0
    assert again.stat().st_size > 0


def test_the_table_names_the_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "contend", "--dir", str(tmp_path), "--page-size", "256KiB",
               "--read-pages", "1", "--write-batch", "2", "--seconds", "0.1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "raw drive" in out and "offload backend (cpu path), beside writes" in out
    assert "2 x raw beside writer + 20 ms" in out


@pytest.mark.parametrize("bad", ["100KiB", "0", "lots"])
def test_a_bad_page_size_is_one_error_line(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "contend", "--page-size", bad]) == 2
    err = capsys.readouterr().err
    assert "error: argument --page-size" in err and "Traceback" not in err
