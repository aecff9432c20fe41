"""offload/config/ is one role per module, read top to bottom: each module imports only the
modules listed before it in the package's docstring (so none imports another in a cycle), none
is over 350 lines, and `offload.config` re-exports every name callers import from it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import offload.config

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "offload" / "config"


def _order() -> list[str]:
    """The modules in the order the package's docstring lists them."""
    doc = offload.config.__doc__ or ""
    return re.findall(r"^- `(\w+)`:", doc, flags=re.M)


def _package_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        out.update(n.split(".")[2] for n in names
                   if n.startswith("offload.config.") and len(n.split(".")) > 2)
    return out


def test_the_docstring_lists_every_module() -> None:
    assert sorted(_order()) == sorted(p.stem for p in PKG.glob("*.py") if p.stem != "__init__")


def test_each_module_imports_only_those_above_it() -> None:
    order = _order()
    bad = {name: sorted(m for m in _package_imports(PKG / f"{name}.py")
                        if m not in order[:i])
           for i, name in enumerate(order)}
    assert not any(bad.values()), f"modules importing one listed after them (or themselves): {bad}"


def test_no_module_over_350_lines() -> None:
    long = {p.name: n for p in PKG.glob("*.py") if (n := len(p.read_text().splitlines())) > 350}
    assert not long, long


def test_every_name_callers_import_is_exported() -> None:
    """Every `from offload.config import X` in the repository (lazy ones included) names an
    export of the package, so no caller depends on which module a name lives in."""
    used: set[str] = set()
    for base in ("offload", "tests", "scripts", "distro"):
        for p in (ROOT / base).rglob("*.py"):
            if PKG in p.parents or "fixtures" in p.parts:
                continue
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == "offload.config":
                    used.update(a.name for a in node.names)
    assert used and used <= set(offload.config.__all__), sorted(used - set(offload.config.__all__))
    assert all(hasattr(offload.config, name) for name in offload.config.__all__)
