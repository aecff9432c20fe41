"""Bench report: throughput against block size per path, with the raw baseline, as a PNG.

Primitives:
- `draw(result, out, title)`: the dispatcher (`offload.commands.bench`) draws the result a
  benchmark's `run` returned (the dict it prints with `--json`) when `--plot out.png` was given.
- `series(result)`: the lines of a throughput result (`store`, `paths`, `hicache`, `redis`; the
  kind is recognised from its shape, `kind_of`): `Series(name, op, xs, ys, baseline)` with block
  sizes in bytes and GB/s. Baselines (raw O_DIRECT disk, NIXL loopback, raw redis-py) are dashed.
- A `bench contend` result (read latencies) is drawn by `offload.bench.contend.contend_figure`.
- A `bench serve` result is not throughput: `draw` gives it two bar panels per prompt length
  (time to first token cold / L1/L2 hit / L3 hit, and the hits' speed-up over cold).
- The drawing: two panels (read, write); lines over a log-2 block-size axis when the result has
  several block sizes, one bar per series (baselines hatched, values written on the bars) when it
  has one (`bench hicache`, a one-size run); matplotlib with the Agg backend (headless), imported
  only here. `--plot` is checked before a benchmark runs (`offload.argtypes.plot_file`).
- `bench plot RESULT.json --plot out.png`: the same from a saved `--json` result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from offload.bench.common import PLOT, Args, Option, Outcome
from offload.config import Size, format_size
from offload.errors import OffloadError, UsageError

PATH_NAMES = {"cpu": "CPU staging", "gds": "GPUDirect Storage", "dpu": "DPU agent (memory)",
              "dpu_disk": "DPU agent (NVMe)", "raw_disk": "raw disk",
              "nixl_loopback": "NIXL loopback"}


@dataclass
class Series:
    name: str
    op: str                          # "read" or "write"
    xs: list[int] = field(default_factory=list)
    ys: list[float] = field(default_factory=list)
    baseline: bool = False

    def add(self, x: int, y: float | None) -> None:
        if y is not None and y > 0:
            self.xs.append(int(x))
            self.ys.append(float(y))


def kind_of(result: dict[str, Any]) -> str:
    if not isinstance(result, dict):
        raise OffloadError("not a bench result: expected a JSON object, the --json output of "
                           "bench store, paths, hicache, redis or serve")
    if result.get("mode") in ("restart", "sweep", "unique") and isinstance(result.get("workload"), dict):
        return "workload"
    if result.get("bench") == "contend" and isinstance(result.get("target"), dict):
        return "contend"
    if isinstance(result.get("sizes"), list) and "raw" in result:
        return "store"
    if isinstance(result.get("sizes"), dict):
        return "paths"
    if "stock_file" in result and "offload" in result:
        return "hicache"
    if isinstance(result.get("rows"), list):
        return "redis"
    if isinstance(result.get("rows"), dict) and all(
            isinstance(r, dict) and isinstance(r.get("cold"), dict)
            for r in result["rows"].values()) and result["rows"]:
        return "serve"
    raise OffloadError("not a bench result: expected the --json output of bench store, paths, "
                       "hicache, redis or serve")


def _collect(lines: dict[tuple[str, str], Series], name: str, op: str, x: int, y: Any,
             baseline: bool = False) -> None:
    s = lines.setdefault((name, op), Series(name, op, baseline=baseline))
    s.add(x, y if isinstance(y, (int, float)) else None)


def series(result: dict[str, Any]) -> list[Series]:
    kind = kind_of(result)
    if kind == "serve":
        raise OffloadError("a bench serve result holds times to first token, not throughput")
    if kind == "contend":
        raise OffloadError("a bench contend result holds read latencies, not throughput")
    lines: dict[tuple[str, str], Series] = {}
    if kind == "store":
        rows = result["sizes"]
        for r in rows:
            x = r["block_bytes"]
            _collect(lines, "block store", "write", x, r.get("put_gbps"))
            _collect(lines, "block store (cold)", "read", x, r.get("cold_get_gbps"))
            _collect(lines, "block store (warm)", "read", x, r.get("warm_get_gbps"))
            # the raw disk measured beside this block size when the result has it
            _collect(lines, "raw disk", "write", x,
                     r.get("raw_write_gbps", result["raw"].get("write_gbps")), True)
            _collect(lines, "raw disk", "read", x,
                     r.get("raw_read_gbps", result["raw"].get("read_gbps")), True)
    elif kind == "paths":
        for label, row in result["sizes"].items():
            x = int(Size.parse(label))
            for path, r in row.items():
                if isinstance(r, dict) and "put_gbps" in r:
                    base = path in ("raw_disk", "nixl_loopback")
                    name = PATH_NAMES.get(path, path)
                    _collect(lines, name, "write", x, r["put_gbps"], base)
                    _collect(lines, name, "read", x, r["get_gbps"], base)
    elif kind == "hicache":
        x = result["page_bytes"]
        for key, name, base in (("offload", "offload backend", False),
                                ("stock_file", "SGLang file backend", False),
                                ("raw", "raw disk", True)):
            _collect(lines, name, "write", x, result[key].get("write_gbps"), base)
            _collect(lines, name, "read", x, result[key].get("read_gbps"), base)
    else:
        for r in result["rows"]:
            x = r["block"]
            _collect(lines, "redis tier", "write", x, r.get("ours_set"))
            _collect(lines, "redis tier", "read", x, r.get("ours_get"))
            _collect(lines, "raw redis-py", "write", x, r.get("raw_set"), True)
            _collect(lines, "raw redis-py", "read", x, r.get("raw_get"), True)
    return [s for s in lines.values() if s.xs]


def draw(result: dict[str, Any], out: str, title: str | None = None) -> str:
    """Write the plot of `result` to `out` (the format named by its extension); returns `out`."""
    import matplotlib.pyplot as plt

    kind = kind_of(result)
    if kind == "workload":
        from offload.bench.workload.plot import workload_figure

        fig = workload_figure(result, title)
    elif kind == "contend":
        from offload.bench.contend import contend_figure

        fig = contend_figure(result, title)
    else:
        fig = serve_figure(result, title) if kind == "serve" else figure(result, title)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def figure(result: dict[str, Any], title: str | None = None) -> Any:
    """The matplotlib Figure of `result`: two panels (read, write), lines or bars."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    lines = series(result)
    if not lines:
        raise OffloadError("the bench result holds no throughput to plot")
    kind = kind_of(result)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=False)
    sizes = sorted({x for s in lines for x in s.xs})
    colors: dict[str, Any] = {}
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, op in zip(axes, ("read", "write")):
        mine = [s for s in lines if s.op == op]
        for s in mine:
            colors.setdefault(s.name, cycle[len(colors) % len(cycle)])
        if len(sizes) == 1:
            _bars(ax, mine, colors)
        else:
            for s in mine:
                ax.plot(s.xs, s.ys, "--" if s.baseline else "-", marker="o", color=colors[s.name],
                        label=s.name + (" (baseline)" if s.baseline else ""))
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [format_size(x) for x in sizes])
            ax.set_xlabel("block size")
            ax.legend(fontsize="small")
        ax.set_ylabel("GB/s")
        ax.set_ylim(bottom=0)
        ax.set_title("read (get)" if op == "read" else "write (put)")
        ax.grid(True, alpha=0.3, axis="y" if len(sizes) == 1 else "both")
    what = (f"throughput at {format_size(sizes[0])} blocks" if len(sizes) == 1
            else "throughput vs block size")
    fig.suptitle(title or f"sglang-offload bench {kind}: {what}")
    fig.tight_layout()
    return fig


SERVE_PHASES = {"cold": "cold (prefill)", "l1l2": "L1/L2 hit", "l3": "L3 hit (after restart)"}


def serve_figure(result: dict[str, Any], title: str | None = None) -> Any:
    """A `bench serve` result: bars per prompt length, time to first token (cold, L1/L2, L3) and
    the hits' speed-up over cold."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rows = result["rows"]
    lengths = list(rows)
    phases = [p for p in SERVE_PHASES if any(p in r for r in rows.values())]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(phases)
    for i, p in enumerate(phases):
        xs = [j + i * width for j in range(len(lengths))]
        ys = [_number(rows[n].get(p, {}).get("ttft_s")) for n in lengths]
        color = f"C{list(SERVE_PHASES).index(p)}"          # one color per phase in both panels
        bars = ax1.bar(xs, ys, width, label=SERVE_PHASES[p], color=color,
                       hatch="//" if p == "cold" else "")
        ax1.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize="x-small", padding=2)
        if p != "cold":
            sp = [_number(rows[n].get(p, {}).get("speedup")) for n in lengths]
            b2 = ax2.bar(xs, sp, width, label=SERVE_PHASES[p], color=color)
            ax2.bar_label(b2, labels=[f"{y:.2f}x" for y in sp], fontsize="x-small", padding=2)
    for ax, ylabel, where in ((ax1, "time to first token (s)", "upper left"),
                              (ax2, "speed-up over cold", "lower right")):
        ax.set_xticks([j + width * (len(phases) - 1) / 2 for j in range(len(lengths))],
                      [f"{int(n) // 1024}K" if str(n).isdigit() and int(n) >= 1024 else str(n)
                       for n in lengths])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize="small", loc=where)
        ax.grid(True, axis="y", alpha=0.3)
        ax.margins(y=0.15)
    ax2.axhline(1.0, color="black", linewidth=0.8)
    srv = result.get("server") or {}
    fig.suptitle(title or f"sglang-offload bench serve: {srv.get('device')}, attention "
                 f"{srv.get('attention_backend')}")
    fig.tight_layout()
    return fig


def _number(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) else 0.0


def _bars(ax: Any, lines: list[Series], colors: dict[str, Any]) -> None:
    """One bar per series at the result's one block size, its GB/s written on it."""
    names = [s.name + (" (baseline)" if s.baseline else "") for s in lines]
    values = [s.ys[0] for s in lines]
    bars = ax.bar(range(len(lines)), values, color=[colors[s.name] for s in lines],
                  hatch=["//" if s.baseline else "" for s in lines], edgecolor="black")
    ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], padding=2)
    ax.margins(y=0.12)
    ax.set_xticks(range(len(lines)), names, rotation=15, ha="right")


OPTIONS = (
    Option(("result",), "a saved `sglang-offload bench TARGET --json` output"),
    Option(PLOT.flags, "where to write the plot (the extension names the format)", None,
           PLOT.type, required=True, metavar="OUT.png"),
    Option(("--title",), "plot title"),
)


def run(args: Args) -> Outcome:
    try:
        with open(args.result) as f:
            result = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"{args.result}: cannot read a JSON bench result ({e})") from None
    print(draw(result, args.plot, args.title))
    return Outcome(None)
