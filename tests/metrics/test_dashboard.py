"""The Grafana dashboard only queries metrics we export (names and label names)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from offload.metrics import PREFIX, TierMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "grafana" / "sglang-offload.json"
# SGLang's own families a panel may use beside ours (their names and labels are proven against a
# real server and a real Prometheus in tests/e2e/test_dashboard_prometheus.py)
SGLANG_USED = {"sglang:cached_tokens_total": {"cache_source"}}


def exported() -> dict[str, set[str]]:
    """Every series name our metrics produce -> the label names it carries (public API only:
    every labelled family gets a child, then the registry is collected)."""
    reg = CollectorRegistry()
    m = TierMetrics(reg)
    m.set_path("cpu")
    m.load_seconds.labels("cpu").observe(0.01)
    m.store_seconds.labels("cpu").observe(0.01)
    m.loaded("cpu", 4, 0.01, 64, 1000.0)
    for gauge in (m.capacity_used, m.capacity, m.blocks):
        gauge.labels("local").set(1)
    out: dict[str, set[str]] = {k: set(v) for k, v in SGLANG_USED.items()}
    for fam in reg.collect():
        for s in fam.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])      # collapsed rows
    return [p for p in out if p.get("type") != "row"]


def problems(dash: dict, names: dict[str, set[str]]) -> list[str]:
    """What is wrong with the dashboard's queries (empty: every query names exported series)."""
    out = []
    for p in panels(dash):
        if not p.get("targets"):
            out.append(f"panel {p['title']!r} has no query")
        for t in p.get("targets", []):
            expr = t["expr"]
            used = re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*(?=\s*[\[{)\s]|$)", expr)
            ours = [u for u in used if u.startswith(PREFIX)]
            theirs = [u for u in used if u in SGLANG_USED]
            if not ours and not theirs:
                out.append(f"panel {p['title']!r}: {expr!r} names none of our metrics")
            out += [f"panel {p['title']!r}: {u} is not exported" for u in used
                    if u.startswith(("sglang_", "sglang:")) and u not in names]
            labels = set().union(set(), *(names.get(m, set()) for m in ours + theirs))
            for grp in re.findall(r"by \(([^)]*)\)", expr):
                out += [f"panel {p['title']!r}: no metric of {expr!r} has label {lab}"
                        for lab in (x.strip() for x in grp.split(",")) if lab not in labels]
    return out


def test_every_panel_queries_only_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    assert len(panels(dash)) >= 10
    assert problems(dash, exported()) == []


def test_the_check_catches_a_wrong_name_or_label():
    dash = json.loads(DASHBOARD.read_text())
    t = panels(dash)[0]["targets"][0]
    t["expr"] = "sum by (tier) (rate(sglang_offload_hitz_total[5m]))"
    assert any("hitz" in p for p in problems(dash, exported()))
    t["expr"] = "sum by (model) (rate(sglang_offload_hits_total[5m]))"
    assert any("label model" in p for p in problems(dash, exported()))


def test_dashboard_covers_the_spec():
    text = DASHBOARD.read_text()
    for family in ("hits", "misses", "bytes", "load_seconds", "store_seconds",
                   "checksum_failures", "evictions", "capacity_used_bytes", "path_info",
                   "load_page_seconds", "write_backlog_pages", "ttft_saved_seconds_total"):
        assert PREFIX + family in text, family
