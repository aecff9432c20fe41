"""Markers by place: every test under tests/e2e/ starts real SGLang servers and is marked `e2e`,
so `pytest -m "not e2e and not slow"` is the quick loop (docs/development.md)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parent / "e2e"

# Where the environment sets PYTHONDONTWRITEBYTECODE (this box and its CI do), every run parsed
# each test module again for pytest's assert rewriting (10-20 s of each run on 2 cores), and
# every process the tests start compiled what it imported again: `offload` in each CLI and agent
# process, the whole of SGLang in each process of a server started from an unpacked tree (the
# patch matrix's reference, `shadow_tree.py`; ~12 s a start). The caches go to __pycache__
# (ignored by git, or a temporary tree), checked as CPython always does (the source's mtime in
# whole seconds and its size; pytest's version too): only a module rewritten in place with the
# same size within the same second would run stale, which no test does
# (tests/launch/test_server_stop_redteam.py shows it).
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    grouped = bool(getattr(config.option, "loadgroup", False))   # set on xdist workers
    for item in items:
        if E2E in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.e2e)
            # pytest-xdist (`-n 2 --dist loadgroup`, pyproject's addopts): every e2e test on one
            # worker, one after another, so no two of their servers (each a host pool of GiBs;
            # SGLang checks the host's free memory at start) ever overlap, while the other
            # worker takes everything else. The group is the nodeid's "@e2e" suffix, what an
            # xdist_group marker becomes; set here because pytest-xdist 3.8 writes it to
            # `item._nodeid`, which pytest 9.2 no longer reads (its node ids are `item._id`):
            # with the marker alone e2e tests ran on both workers at once
            if grouped and not item.nodeid.endswith("@e2e"):
                _group(item, "e2e")


def _group(item: pytest.Item, name: str) -> None:
    """The "@name" suffix on the item's node id, where this pytest keeps it (private API)."""
    try:
        from _pytest.nodeid import coerce_node_id  # pytest 9.2: a structured id in `_id`
    except ImportError:                             # older: the string in `_nodeid`
        item._nodeid = f"{item.nodeid}@{name}"   # type: ignore[attr-defined]
        return
    item._id = coerce_node_id(f"{item.nodeid}@{name}")   # type: ignore[attr-defined]
