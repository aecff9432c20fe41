"""`bench ... --plot out.png` and `bench plot`: throughput vs block size per path with the raw
baseline, and a `bench serve` result's times to first token (Agg)."""

from __future__ import annotations

import json

import pytest

from offload.bench import plot
from offload.cli import main
from offload.errors import OffloadError

PNG = b"\x89PNG\r\n\x1a\n"

# The shapes the four benchmarks print with --json (trimmed to the fields the plot reads).
STORE = {"raw": {"write_gbps": 2.0, "read_gbps": 3.0},
         "sizes": [{"block_bytes": 1 << 20, "put_gbps": 1.0, "cold_get_gbps": 2.0,
                    "warm_get_gbps": 2.5},
                   {"block_bytes": 4 << 20, "put_gbps": 1.8, "cold_get_gbps": 2.8,
                    "warm_get_gbps": 2.9}]}
PATHS = {"total_bytes": 1 << 30, "batch": 8, "sizes": {
    "2MiB": {"raw_disk": {"put_gbps": 2.0, "get_gbps": 3.0},
             "cpu": {"put_gbps": 1.5, "get_gbps": 2.5, "put_ratio": 0.75},
             "gds": {"skipped": "no GPU"},
             "nixl_loopback": {"put_gbps": 9.0, "get_gbps": 9.5},
             "dpu": {"put_gbps": 8.0, "get_gbps": 8.5}},
    "8MiB": {"raw_disk": {"put_gbps": 2.1, "get_gbps": 3.1},
             "cpu": {"put_gbps": 1.9, "get_gbps": 2.9},
             "dpu": {"skipped": "NIXL loopback failed"}}}}
HICACHE = {"page_bytes": 8 << 20, "raw": {"write_gbps": 2.0, "read_gbps": 3.0},
           "stock_file": {"write_gbps": 0.5, "read_gbps": 1.0},
           "offload": {"write_gbps": 1.8, "read_gbps": 2.7}}
REDIS = {"url": "redis://x", "rows": [{"block": 1 << 20, "raw_set": 1.0, "ours_set": 0.9,
                                       "raw_get": 1.2, "ours_get": 1.1}]}
SERVE = {"lengths": [2048, 4096], "max_new_tokens": 8, "seed": 1,
         "rows": {"2048": {"cold": {"ttft_s": 1.0, "cached_tokens": 0},
                           "l1l2": {"ttft_s": 0.5, "speedup": 2.0, "same_output": True},
                           "l3": {"ttft_s": 0.6, "speedup": 1.67, "same_output": True}},
                  "4096": {"cold": {"ttft_s": 2.5, "cached_tokens": 0},
                           "l1l2": {"ttft_s": 1.0, "speedup": 2.5, "same_output": True}}},
         "server": {"device": "cpu", "attention_backend": "torch_native"}}


def _lines(result):
    return {(s.name, s.op): (s.xs, s.ys, s.baseline) for s in plot.series(result)}


def test_series_of_every_bench_shape():
    s = _lines(STORE)
    assert s[("raw disk", "read")] == ([1 << 20, 4 << 20], [3.0, 3.0], True)
    assert s[("block store (cold)", "read")][1] == [2.0, 2.8]
    assert s[("block store", "write")][2] is False
    p = _lines(PATHS)
    assert p[("CPU staging", "write")][:2] == ([2 << 20, 8 << 20], [1.5, 1.9])
    assert p[("DPU agent (memory)", "read")][:2] == ([2 << 20], [8.5])   # skipped sizes left out
    assert p[("raw disk", "write")][2] and p[("NIXL loopback", "read")][2]
    assert not any(name == "GPUDirect Storage" for name, _ in p)         # skipped: no line
    h = _lines(HICACHE)
    assert h[("SGLang file backend", "read")][:2] == ([8 << 20], [1.0])
    assert h[("raw disk", "write")][2]
    r = _lines(REDIS)
    assert r[("redis tier", "read")][:2] == ([1 << 20], [1.1]) and r[("raw redis-py", "read")][2]
    with pytest.raises(OffloadError, match="not a bench result"):
        plot.series({"something": 1})


@pytest.mark.parametrize("result", [STORE, PATHS, HICACHE, REDIS],
                         ids=["store", "paths", "hicache", "redis"])
def test_draw_writes_a_png(tmp_path, result):
    out = tmp_path / "out.png"
    assert plot.draw(result, str(out)) == str(out)
    data = out.read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000


def test_bench_store_plot_option_through_the_cli(tmp_path, capsys):
    out = tmp_path / "store.png"
    rc = main(["bench", "store", "--sizes", "64KiB,256KiB", "--total", "4MiB",
               "--lookup-blocks", "0", "--dir", str(tmp_path), "--json", "--plot", str(out)])
    stdout, err = capsys.readouterr()
    assert rc == 0 and out.read_bytes().startswith(PNG) and f"plot: {out}" in err
    saved = tmp_path / "store.json"
    saved.write_text(stdout)
    assert [r["block_bytes"] for r in json.loads(stdout)["sizes"]] == [64 << 10, 256 << 10]
    again = tmp_path / "again.png"
    assert main(["bench", "plot", str(saved), "--plot", str(again)]) == 0
    assert again.read_bytes().startswith(PNG)
    eq = tmp_path / "eq.png"                                # --plot=OUT, among other options
    assert main(["bench", "store", "--sizes", "64KiB", f"--plot={eq}", "--total", "1MiB",
                 "--lookup-blocks", "0", "--dir", str(tmp_path)]) == 0
    assert eq.read_bytes().startswith(PNG)


def test_plot_errors_are_clean(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{\"x\": 1}")
    assert main(["bench", "plot", str(bad), "--plot", str(tmp_path / "o.png")]) == 2
    assert "not a bench result" in capsys.readouterr().err
    assert main(["bench", "plot", str(tmp_path / "missing.json"), "--plot", "o.png"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_one_block_size_is_a_bar_chart_and_several_are_lines():
    import matplotlib.pyplot as plt

    fig = plot.figure(HICACHE)                      # one page size: bars, not lone dots
    try:
        assert fig.get_suptitle() == "sglang-offload bench hicache: throughput at 8MiB blocks"
        for ax in fig.axes:
            assert len(ax.patches) == 3 and not ax.lines
            labels = [t.get_text() for t in ax.get_xticklabels()]
            assert labels == ["offload backend", "SGLang file backend", "raw disk (baseline)"]
        read = fig.axes[0]
        assert sorted(p.get_height() for p in read.patches) == [1.0, 2.7, 3.0]
    finally:
        plt.close(fig)
    fig = plot.figure(STORE)                        # two sizes: one line per series
    try:
        assert "throughput vs block size" in fig.get_suptitle()
        assert all(ax.lines and not ax.patches for ax in fig.axes)
    finally:
        plt.close(fig)


def test_a_saved_bench_serve_result_draws(tmp_path, capsys):
    """`bench plot` draws what `bench serve --json` saved (before: 'not a bench result')."""
    assert plot.kind_of(SERVE) == "serve"
    saved = tmp_path / "serve.json"
    saved.write_text(json.dumps(SERVE))
    out = tmp_path / "serve.png"
    assert main(["bench", "plot", str(saved), "--plot", str(out)]) == 0
    assert out.read_bytes().startswith(PNG) and capsys.readouterr().out.strip() == str(out)
    fig = plot.serve_figure(SERVE)
    try:
        ttft, speedup = fig.axes
        assert sorted(p.get_height() for p in ttft.patches) == [0, 0.5, 0.6, 1.0, 1.0, 2.5]
        assert sorted(p.get_height() for p in speedup.patches) == [0, 1.67, 2.0, 2.5]
        assert [t.get_text() for t in ttft.get_xticklabels()] == ["2K", "4K"]
        assert fig.get_suptitle() == "sglang-offload bench serve: cpu, attention torch_native"
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    for bad in ({"rows": {}}, {"rows": {"2048": {"l3": {}}}}, [1, 2]):
        with pytest.raises(OffloadError, match="not a bench result"):
            plot.kind_of(bad)


@pytest.mark.parametrize("target,shows", [("store", "GB/s against block size"),
                                          ("hicache", "at the page size"),
                                          ("serve", "time to first token")])
def test_plot_help_says_what_each_target_draws(target, shows, capsys):
    assert main(["bench", target, "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    plot_help = help_text[help_text.index("--plot OUT.png draw"):]
    assert shows in plot_help
    assert ("GB/s" in plot_help) == (target != "serve")
