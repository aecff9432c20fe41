"""The backend's shape (issue 37): `OffloadStorage` a face over parts, not mixins; every SGLang
data-path call guarded once, on the face; every module of offload/hicache small."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

HICACHE = Path(__file__).resolve().parents[2] / "offload" / "hicache"
MAX_LINES = 350

DATA_PATH = ("batch_exists", "batch_get_v1", "batch_set_v1", "batch_exists_v2", "batch_get_v2",
             "batch_set_v2", "exists", "get", "set", "batch_get", "batch_set")


def _modules() -> list[Path]:
    return sorted(HICACHE.glob("*.py"))


def test_no_module_over_the_limit() -> None:
    long = {p.name: n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"offload/hicache modules over {MAX_LINES} lines: {long}"


def test_no_class_has_several_bases() -> None:
    """Parts sharing one `BackendState`, not mixins: every class has at most one base."""
    bad = {f"{p.name}:{node.name}": [ast.unparse(b) for b in node.bases]
           for p in _modules() for node in ast.walk(ast.parse(p.read_text()))
           if isinstance(node, ast.ClassDef) and len(node.bases) > 1}
    assert not bad, f"classes with several bases under offload/hicache: {bad}"


def test_each_data_path_call_is_guarded_once_on_the_face() -> None:
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from offload.hicache.backend import OffloadStorage

    unguarded = [m for m in DATA_PATH if not hasattr(vars(OffloadStorage)[m], "failures")]
    assert not unguarded, f"OffloadStorage calls without never_raises: {unguarded}"
    guards = [p.name for p in _modules() if p.name != "backend.py" and any(
        isinstance(n, ast.Name) and n.id == "never_raises" for n in ast.walk(ast.parse(p.read_text())))]
    assert not guards, f"never_raises inside the parts (guard once, on the face): {guards}"
