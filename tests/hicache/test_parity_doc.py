"""docs/design/hicache.md's parity table stays true: the features come from SGLang's installed source.

Every field of `HiCacheStorageConfig`, every public method of `HiCacheStorage`, every
`--hicache-mem-layout` choice and every SGLang function that compares the storage backend with a
backend name must be named (in backticks) in the table's first column; every file named in its
third column must exist; every capability `OffloadStorage` declares must be listed; and
`OffloadStorage` implements every storage method Mooncake's backend does.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

hs = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "design" / "hicache.md"
SECTION = "## Parity with SGLang's Mooncake backend"
BACKEND_NAMES = {"file", "mooncake", "mori", "hf3fs", "nixl", "eic", "simm", "tensorcast",
                 "seaweedfs", "npu_memcache", "aibrix"}
# SGLang's HiCache code: where a storage-backend name can gate a feature.
GATE_FILES = ("managers/cache_controller.py", "managers/scheduler.py",
              "mem_cache/hybrid_cache/hybrid_cache_controller.py", "mem_cache/mla_host_dedup.py",
              "arg_groups/hicache_hook.py", "arg_groups/kv_cache_hook.py",
              "arg_groups/memory_hook.py")


def _srt() -> Path:
    import sglang

    return Path(sglang.__file__).parent / "srt"


def _table() -> list[list[str]]:
    text = DOC.read_text()
    body = text[text.index(SECTION):]
    body = body[:body.index("\n## ", len(SECTION))]
    rows = [ln for ln in body.splitlines() if ln.startswith("| ") and not ln.startswith("|---")]
    cells = [[c.strip() for c in ln.strip("|").split(" | ")] for ln in rows]
    assert cells[0] == ["SGLang feature", "ours", "file", "Mooncake"]
    assert all(len(c) == 4 for c in cells), [c for c in cells if len(c) != 4]
    return cells[1:]


def _ticked(cell: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", cell))


def _strings(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_strings(e) for e in node.elts)) if node.elts else set()
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "frozenset" and node.args:
        return _strings(node.args[0])
    return set()


def _name_gates() -> set[str]:
    """Functions (or module constants) of SGLang's HiCache code gating on a backend name."""
    found: set[str] = set()
    for rel in GATE_FILES:
        tree = ast.parse((_srt() / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and "STORAGE" in ast.unparse(node.targets[0]):
                if _strings(node.value) & BACKEND_NAMES:
                    found.add(ast.unparse(node.targets[0]))
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for sub in ast.walk(node):
                named = isinstance(sub, ast.Compare) and any(
                    _strings(c) & BACKEND_NAMES for c in [sub.left, *sub.comparators]) and any(
                    "storage_backend" in ast.unparse(c) for c in [sub.left, *sub.comparators])
                mooncake_type = (isinstance(sub, ast.Call) and getattr(sub.func, "id", "")
                                 == "isinstance" and "MooncakeStore" in ast.unparse(sub))
                if named or mooncake_type:
                    found.add(node.name)
    return found


def _layouts() -> set[str]:
    tree = ast.parse((_srt() / "arg_groups/fields/memory.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "hicache_mem_layout":
            for kw in (k for c in ast.walk(node) if isinstance(c, ast.Call) for k in c.keywords):
                if kw.arg == "choices":
                    return _strings(kw.value)
    raise AssertionError("no --hicache-mem-layout choices in SGLang's memory.py")


def test_every_sglang_feature_has_a_row():
    named = set().union(*(_ticked(row[0]) for row in _table()))
    features = {f.name for f in dataclasses.fields(hs.HiCacheStorageConfig)}
    features |= {m for m in vars(hs.HiCacheStorage) if not m.startswith("_")}
    features |= _layouts()
    gates = _name_gates()
    assert {"attach_storage_backend", "should_backup", "_hicache_l3_layout"} <= gates
    missing = sorted((features | gates) - named)
    assert not missing, f"docs/design/hicache.md parity table lacks: {missing}"


def test_files_named_exist_and_capabilities_are_listed():
    from offload.hicache.backend import OffloadStorage

    rows = _table()
    for row in rows:
        for path in _ticked(row[2]):
            assert (REPO / path).is_file(), f"{path} (row {row[0][:40]!r}) does not exist"
    text = DOC.read_text()
    for cap in OffloadStorage.HICACHE_CAPABILITIES:
        assert f"`{cap}`" in text, cap


def test_we_implement_every_storage_method_mooncake_does():
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    from offload.hicache.backend import OffloadStorage

    interface = {m for m in vars(hs.HiCacheStorage) if not m.startswith("_")}
    theirs = {m for m in vars(MooncakeStore) if m in interface} | {"describe_l3_object_layout"}
    ours = {m for m in theirs if m in vars(OffloadStorage) or any(
        m in vars(base) for base in OffloadStorage.__mro__[1:] if base is not hs.HiCacheStorage)}
    assert ours == theirs, sorted(theirs - ours)
