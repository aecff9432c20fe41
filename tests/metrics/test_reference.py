"""docs/reference/metrics.md names every metric family the backend exports."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry  # noqa: E402

from offload.metrics import TierMetrics  # noqa: E402

DOC = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "metrics.md").read_text()


def test_every_metric_family_is_documented() -> None:
    reg = CollectorRegistry()
    TierMetrics(reg)
    names = {m.name + ("_total" if m.type == "counter" else "") for m in reg.collect()}
    missing = sorted(n for n in names if f"`{n}`" not in DOC)
    assert not missing, f"docs/reference/metrics.md lacks {missing}"
