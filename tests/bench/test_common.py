"""The benchmarks' shared helpers, their declared options, and results handed to the plot."""

from __future__ import annotations

import argparse
import importlib
import json

import pytest

from offload.bench import common, plot
from offload.commands import bench as cmd


def test_median_of_is_leaf_wise_and_keeps_what_is_not_a_number():
    tries = [{"a": 1.0, "b": {"c": 10, "s": "x"}, "ok": True},
             {"a": 3.0, "b": {"c": 30, "s": "y"}, "ok": False},
             {"a": 2.0, "b": {"c": 20}, "ok": True}]
    assert common.median_of(tries) == {"a": 2.0, "b": {"c": 20, "s": "x"}, "ok": True}


def test_timers_return_seconds_and_the_value():
    assert common.timed(lambda: None) >= 0
    wall, cpu, value = common.timed_cpu(lambda: [True, False])
    assert wall >= 0 and cpu >= 0 and value == [True, False]


def test_cache_helpers_open_only_the_named_files(tmp_path):
    (tmp_path / "a.slab").write_bytes(b"x" * 4096)
    (tmp_path / "b.bin").write_bytes(b"y")
    (tmp_path / "c.bin").write_bytes(b"")
    (tmp_path / "c.bin").chmod(0)                       # opening it would fail (unless root)
    common.drop_cache(str(tmp_path), ".slab")
    common.fsync_files(str(tmp_path), ".slab")
    assert (tmp_path / "a.slab").read_bytes() == b"x" * 4096


def test_a_tree_is_dropped_from_the_page_cache_file_by_file_links_left_alone(tmp_path):
    (tmp_path / "l3" / "objects").mkdir(parents=True)
    (tmp_path / "l3" / "index.db").write_bytes(b"i" * 8192)
    (tmp_path / "l3" / "objects" / "page.bin").write_bytes(b"p" * 4096)
    (tmp_path / "l3" / "objects" / "away").symlink_to(tmp_path / "elsewhere")   # dangling
    assert common.drop_tree_cache(str(tmp_path / "l3")) == 2
    assert (tmp_path / "l3" / "objects" / "page.bin").read_bytes() == b"p" * 4096   # kept


@pytest.mark.parametrize("target", [t for t in cmd.BENCHES])
def test_every_benchmark_declares_its_options_as_data(target):
    module = importlib.import_module(cmd.BENCHES[target][0])
    assert all(isinstance(o, common.Option) for o in module.OPTIONS)
    p = argparse.ArgumentParser()
    cmd.add_options(p, module.OPTIONS)                  # every declaration is a valid flag
    assert p.format_help()


def test_options_become_flags_with_their_types_defaults_and_choices():
    p = argparse.ArgumentParser()
    cmd.add_options(p, (common.Option(("--n",), "count", 3, int),
                        common.Option(("--mode",), "mode", "a", choices=("a", "b")),
                        common.Option(("--yes",), "switch", flag=True),
                        common.Option(("path",), "positional")))
    args = p.parse_args(["here", "--n", "5", "--yes"])
    assert (args.n, args.mode, args.yes, args.path) == (5, "a", True, "here")
    with pytest.raises(SystemExit):
        p.parse_args(["here", "--mode", "c"])


def test_run_returns_the_result_that_the_plot_draws(tmp_path, capsys, monkeypatch):
    drawn = []
    monkeypatch.setattr(plot, "draw", lambda result, out: drawn.append((result, out)) or out)
    opts = ["--sizes", "64KiB", "--total", "1MiB", "--lookup-blocks", "0", "--repeat", "1",
            "--dir", str(tmp_path), "--json"]
    assert cmd.run(argparse.Namespace(target="store", options=opts + ["--plot", "o.png"])) == 0
    printed = json.loads(capsys.readouterr().out)
    assert len(drawn) == 1 and drawn[0][1] == "o.png"
    assert drawn[0][0]["sizes"] == printed["sizes"]      # the same result, handed over directly
