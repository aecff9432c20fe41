"""The code stays lint-clean, typed where promised, and shaped as ARCHITECTURE.md says.

ruff (lint + import order) and mypy (the whole package) run with the settings in
pyproject.toml; argparse lives only in the command modules (and launch/, which reads SGLang's own
flags); no import cycle between units (top-level modules and packages, lazy imports counted);
the disk store's two halves stay apart (index/ is SQLite only and never imports slab/; slab/ is
files only and never imports sqlite3 or index/) and its classes are parts, not mixins (none has
more than one base class); launch/ never imports commands/ (it builds a store through
offload.store.factory); `argparse` lives in the command modules, launch/, cli.py and argtypes.py.
No store capability is probed by attribute name: no `getattr` / `hasattr` in offload/ with a string
naming a member of the Protocols of store/base.py and transfer/base.py, or an attribute a
composite's `parts()` returns (both computed from the source; `isinstance` and
`offload.store.base.walk` / `find` instead).
Under tests/, no module imports a `test_*` module: shared helpers live in helper modules and
conftest.py files.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "offload"


def _tool(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_ruff_is_clean() -> None:
    r = _tool("ruff", "check", "offload", "tests", "scripts", "distro")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_is_clean() -> None:
    r = _tool("mypy")
    assert r.returncode == 0, r.stdout + r.stderr


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (never run)."""
    return {id(n) for top in tree.body
            if isinstance(top, ast.If) and isinstance(top.test, ast.Name)
            and top.test.id == "TYPE_CHECKING" for n in ast.walk(top)}


def _imports(path: Path, runtime: bool = False) -> set[str]:
    """Modules `path` imports; `runtime`: leave out those under `if TYPE_CHECKING:`."""
    out: set[str] = set()
    tree = ast.parse(path.read_text())
    skip = _type_only(tree) if runtime else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def test_argparse_only_in_the_command_modules() -> None:
    allowed = ("commands", "launch")
    bad = [str(p.relative_to(ROOT)) for p in _modules()
           if "argparse" in _imports(p, runtime=True) and p.relative_to(PKG).parts[0] not in allowed
           and p.name not in ("cli.py", "argtypes.py")]
    assert not bad, f"argparse imported outside offload/commands and offload/launch: {bad}"


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "offload" else None


@pytest.mark.parametrize("a,b", [("transfer", "agent"), ("agent", "transfer"), ("store", "transfer"),
                                 ("store", "agent"), ("store", "hicache"), ("hw", "hicache")])
def test_no_import_from_one_package_into_the_other(a: str, b: str) -> None:
    """`a` never imports `b` (the registry reaches across by a lazy import path instead)."""
    bad = [str(p.relative_to(ROOT)) for p in (PKG / a).rglob("*.py")
           if any(_package(m) == b for m in _imports(p))]
    assert not bad, f"offload.{a} imports offload.{b}: {bad}"


DISK = PKG / "store" / "disk"


def _under(pkg: Path) -> list[Path]:
    return sorted(p for p in pkg.rglob("*.py") if "__pycache__" not in p.parts)


def _names(imports: set[str], *prefixes: str) -> list[str]:
    return sorted(m for m in imports if any(m == p or m.startswith(p + ".") for p in prefixes))


def test_disk_index_never_imports_slab() -> None:
    bad = {str(p.relative_to(ROOT)): _names(_imports(p), "offload.store.disk.slab")
           for p in _under(DISK / "index")}
    assert _under(DISK / "index") and not any(bad.values()), f"index/ imports slab/: {bad}"


def test_disk_slab_never_imports_sqlite_or_index() -> None:
    bad = {str(p.relative_to(ROOT)): _names(_imports(p), "sqlite3", "offload.store.disk.index")
           for p in _under(DISK / "slab")}
    assert _under(DISK / "slab") and not any(bad.values()), f"slab/ imports sqlite3 or index/: {bad}"


def _bases(node: ast.ClassDef) -> list[str]:
    """A class's base classes as written, leaving out `object` and `Protocol` (`Generic[...]` too)."""
    names = [ast.unparse(b) for b in node.bases]
    return [n for n in names if n not in ("object", "Protocol") and not n.startswith("Generic[")]


def test_disk_store_classes_are_parts_not_mixins() -> None:
    """`DiskStore` is a face over parts that share one state object (`disk/state.py`): no class
    under offload/store/disk inherits from more than one class."""
    bad = {f"{p.relative_to(ROOT)}:{node.name}": _bases(node) for p in _under(DISK)
           for node in ast.walk(ast.parse(p.read_text()))
           if isinstance(node, ast.ClassDef) and len(_bases(node)) > 1}
    assert not bad, f"classes with several base classes (mixins) under offload/store/disk: {bad}"


def test_launch_never_imports_commands() -> None:
    bad = {str(p.relative_to(ROOT)): _names(_imports(p), "offload.commands")
           for p in _under(PKG / "launch")}
    assert not any(bad.values()), f"offload.launch imports offload.commands: {bad}"


def test_config_imports_no_store() -> None:
    """The config tree (and the Redis URL grammar in it) stands below every tier."""
    bad = {str(p.relative_to(ROOT)): _names(_imports(p), "offload.store")
           for p in _under(PKG / "config")}
    assert _under(PKG / "config") and not any(bad.values()), f"offload/config/ imports {bad}"


def test_top_level_holds_only_the_shared_modules() -> None:
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert top == ["__init__.py", "agree.py", "argtypes.py", "cli.py", "errors.py", "keys.py",
                   "metrics.py", "redact.py", "secret.py"]


def test_contract_imports_no_sglang() -> None:
    code = ("import sys, offload.hicache, offload.hicache.contract, offload.launch.compose;"
            "print(any(m.startswith('sglang') for m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.strip() == "False", r.stdout + r.stderr


def test_offload_storage_is_importable_where_users_name_it() -> None:
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from offload.hicache import OffloadStorage
    from offload.hicache.backend import OffloadStorage as direct

    assert OffloadStorage is direct


def _unit(module: str) -> str | None:
    """The unit a module belongs to: a top-level module (`offload.redact`) or a package
    (`offload.store`, whatever is under it)."""
    parts = module.split(".")
    if parts[0] != "offload" or len(parts) < 2:
        return None
    name = parts[1]
    return name if (PKG / name).is_dir() or (PKG / f"{name}.py").is_file() else None


def test_no_import_cycle_between_units() -> None:
    """Zero cycles between the package's units (each top-level module and each package), counting
    every import that runs, lazy ones inside functions included (only `if TYPE_CHECKING:` is
    left out): a cycle is a pair of rooms a newcomer cannot read one before the other."""
    edges: dict[str, dict[str, str]] = {}
    for p in _modules():
        me = _unit("offload." + ".".join(p.relative_to(PKG).with_suffix("").parts))
        for m in _imports(p, runtime=True):
            other = _unit(m)
            if me and other and other != me:
                edges.setdefault(me, {}).setdefault(other, f"{p.relative_to(ROOT)} imports {m}")

    def path(start: str, goal: str) -> list[str] | None:
        seen, todo = {start}, [[start]]
        while todo:
            trail = todo.pop()
            for nxt in edges.get(trail[-1], {}):
                if nxt == goal:
                    return trail + [nxt]
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(trail + [nxt])
        return None

    cycles = []
    for a, outs in sorted(edges.items()):
        for b in sorted(outs):
            back = path(b, a)
            if back:
                cycles.append(" -> ".join([a, *back]) + f" ({outs[b]}; "
                              + "; ".join(edges[x][y] for x, y in zip(back, back[1:])) + ")")
    assert not cycles, "import cycles between units:\n" + "\n".join(cycles)


def test_no_test_module_imports_another() -> None:
    """Helpers shared by tests live in helper modules and conftest.py fixtures
    (tests/store/stores.py opens a disk store), never in a `test_*` module another one imports:
    importing a test module runs its collection twice and hides what is shared. Scripts in strings
    (run by a child process) are read too."""
    pattern = re.compile(r"^\s*(?:from\s+tests(?:\.\w+)*\.test_\w+\s+import|import\s+tests(?:\.\w+)*"
                         r"\.test_\w+|from\s+tests(?:\.\w+)*\s+import\s+(?:\(?\s*)test_\w+)", re.M)
    bad = [f"{p.relative_to(ROOT)}: {m.group(0).strip()}"
           for p in sorted((ROOT / "tests").rglob("*.py")) if "fixtures" not in p.parts
           for m in pattern.finditer(p.read_text())]
    assert not bad, "test modules imported by others:\n" + "\n".join(bad)


CAPABILITY_MODULES = (PKG / "store" / "base.py", PKG / "transfer" / "base.py")


def _protocol_members(path: Path) -> set[str]:
    """The methods and attributes the Protocols of `path` declare (read from its source)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and any(ast.unparse(b) == "Protocol" for b in node.bases):
            out.update(n.name for n in node.body if isinstance(n, ast.FunctionDef))
            out.update(n.target.id for n in node.body
                       if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))
    return out


def _part_attributes(path: Path) -> set[str]:
    """The attributes of `self` a `parts()` of `path` returns (a composite's inner stores: the
    names a walk by attribute would probe, `local`, `shared`, `store`...)."""
    return {n.attr for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef) and node.name == "parts"
            for n in ast.walk(node) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}


def _capability_probes(path: Path, names: set[str]) -> list[str]:
    """`getattr(x, "name")` / `hasattr(x, "name")` calls in `path` naming one of `names`."""
    return [f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant) and node.args[1].value in names]


def test_no_capability_probed_by_attribute_name() -> None:
    """What a store can do is declared (the Protocols of store/base.py and transfer/base.py,
    asked with `isinstance`; a composite's parts by `walk` / `find`), never probed by name: no
    `getattr` / `hasattr` with a string naming a member of those Protocols, or an attribute a
    composite's `parts()` returns, anywhere in offload/."""
    names = set().union(*(_protocol_members(p) for p in CAPABILITY_MODULES),
                        *(_part_attributes(p) for p in _modules()))
    assert {"durable", "register_region", "commit_now", "parts", "name", "local", "shared",
            "drive_stores"} <= names
    bad = [probe for p in _modules() for probe in _capability_probes(p, names)]
    assert not bad, "capabilities probed by attribute name:\n" + "\n".join(bad)
