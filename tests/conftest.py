"""Markers by place: every test under tests/e2e/ starts real SGLang servers and is marked `e2e`,
so `pytest -m "not e2e and not slow"` is the quick loop (docs/development.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parent / "e2e"

# Where the environment sets PYTHONDONTWRITEBYTECODE (this box and its CI do), every run parsed
# each test module again for pytest's assert rewriting and compiled `offload` again in every
# process the tests start: 10-20 s of each run on 2 cores. The caches go to __pycache__ (ignored
# by git); a stale one is never used (keyed by the source's mtime and size, and pytest's version).
sys.dont_write_bytecode = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if E2E in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.e2e)
