"""The figure of a `bench workload` result (`--plot`, `bench plot`): TTFT p50 / p90 per tier
before and after the restart (bars), with --unique the mean / p90 TTFT per tier (bars), or for
a sweep the p90 TTFT per user count and tier (lines) against the target (dashed)."""

from __future__ import annotations

from typing import Any


def workload_figure(result: dict[str, Any], title: str | None = None) -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    if result.get("mode") == "sweep":
        s = result["sweep"]
        for tier, rounds in s["steps"].items():
            rows = rounds[0] if rounds else []
            ax.plot([r["users"] for r in rows], [r["ttft_ms"]["p90"] for r in rows], marker="o",
                    label=f"{tier} (most within: {s['max_users'][tier]})")
        ax.axhline(s["ttft_target_ms"], linestyle="--", color="grey", label="p90 target")
        ax.set_xlabel("users in flight")
        ax.set_ylabel("p90 TTFT (ms)")
    elif result.get("mode") == "unique":
        summary = result.get("summary") or {}
        cells = [summary[tier]["ttft_ms"] for tier in summary]
        xs = range(len(cells))
        ax.bar([x - 0.2 for x in xs], [c["mean"] or 0 for c in cells], 0.4, label="mean")
        ax.bar([x + 0.2 for x in xs], [c["p90"] or 0 for c in cells], 0.4, label="p90")
        ax.set_xticks(list(xs), list(summary))
        ax.set_ylabel("TTFT (ms), every prompt unique")
    else:
        summary = result.get("summary") or {}
        labels = [f"{tier}\n{phase}" for tier in summary for phase in summary[tier]]
        cells = [summary[tier][phase]["ttft_ms"] for tier in summary for phase in summary[tier]]
        xs = range(len(cells))
        ax.bar([x - 0.2 for x in xs], [c["p50"] or 0 for c in cells], 0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], [c["p90"] or 0 for c in cells], 0.4, label="p90")
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel("TTFT (ms)")
    ax.legend()
    ax.set_title(title or "bench workload: SGLang's client, no L3 vs file L3 vs ours")
    fig.tight_layout()
    return fig
