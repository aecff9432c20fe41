"""`sglang-offload bench hicache` runs end to end on a tiny pool (the figures are not checked)."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from offload.commands import bench as cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_bench_hicache_tiny_run(tmp_path, capsys):
    args = argparse.Namespace(target="hicache",
                              options=["--pages", "2", "--dir", str(tmp_path), "--json"])
    assert cli.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["page_bytes"] == 8 << 20 and out["total_bytes"] == 16 << 20
    for side in ("raw", "stock_file", "offload"):
        assert out[side]["write_gbps"] > 0 and out[side]["read_gbps"] > 0
    assert set(out["targets_met"]) == {"write_vs_stock", "read_vs_stock", "write_vs_raw",
                                       "read_vs_raw", "exists_us_per_key"}
    assert os.listdir(tmp_path) == []  # everything written was removed


def test_bench_hicache_rejects_bad_pages(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:   # a usage error: argparse's exit 2, naming the option
        cli.run(argparse.Namespace(target="hicache", options=["--pages", "0"]))
    assert e.value.code == 2 and "--pages" in capsys.readouterr().err
