"""Markers by place: every test under tests/e2e/ starts real SGLang servers and is marked `e2e`,
so `pytest -m "not e2e and not slow"` is the quick loop (docs/development.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parent / "e2e"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if E2E in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.e2e)
