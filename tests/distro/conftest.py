"""Fixtures for the distribution build: the build script (loaded by path), the pinned upstream wheel
(downloaded once into ~/.cache/sglang-offload/wheels; a failed download fails the tests), that wheel
unpacked as is (the unpatched upstream, whatever .venv holds), the patched wheel built from it, and
a scratch virtualenv with that wheel installed.

The scratch venv is a plain `python -m venv` (no system site-packages) with only the patched wheel
(`--no-deps`). SGLang's modules need torch and friends to import, which that venv does not have, so
tests byte-compile the installed files there and import them in this project's .venv with
PYTHONPATH pointing at the scratch site-packages (`run_probes`), which shadows the installed SGLang.
The probe scripts (probe_*.py) run once per tree, all in one interpreter, to import SGLang once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def load_script(path: Path, name: str) -> ModuleType:
    """Import a script by path (distro/ is deliberately not a package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


PROBES = ["imports", "cache_salt", "offload_backend"]  # offload_backend last: it stubs a module


def site_without(tmp_path_factory: pytest.TempPathFactory, patch: str) -> Path:
    """An unpacked SGLang with the series less `patch` (distro/shadow_tree.py): the reference a
    patch's failing-without test probes."""
    shadow = load_script(REPO / "distro" / "shadow_tree.py", "sglang_offload_shadow_tree")
    out = tmp_path_factory.mktemp(f"without-{patch}") / "tree"
    applied = shadow.build(out, [patch])
    assert not any(p.name.startswith(patch) for p in applied)
    return out


def run_probes(site: Path | None = None, names: list[str] = PROBES) -> dict:
    """Run tests/distro/run_probes.py with this .venv's Python; `site` first on sys.path if given."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if site is not None:
        env["PYTHONPATH"] = str(site)
    result = subprocess.run(
        [sys.executable, str(HERE / "run_probes.py"), *names], capture_output=True, text=True,
        env=env, cwd=REPO, timeout=600,
    )
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("PROBE ")]
    assert result.returncode == 0 and lines, f"probes failed:\n{result.stdout}\n{result.stderr}"
    results = json.loads(lines[-1][len("PROBE "):])
    for name, value in results.items():
        assert "exception" not in value, f"probe {name} raised:\n{value['exception']}"
    return results


@pytest.fixture(scope="session")
def upstream_site(pinned_wheel, tmp_path_factory) -> Path:
    """The pinned upstream wheel unpacked as is: the unpatched SGLang (.venv holds the patched one)."""
    site = tmp_path_factory.mktemp("upstream")
    with zipfile.ZipFile(pinned_wheel) as zf:
        zf.extractall(site, [n for n in zf.namelist() if n.startswith(("sglang/", "sglang-"))])
    return site


@pytest.fixture(scope="session")
def upstream_probes(upstream_site) -> dict:
    """Probe results from the unpatched upstream SGLang (not `imports`: a patch adds a module)."""
    return run_probes(upstream_site, [name for name in PROBES if name != "imports"])


@pytest.fixture(scope="session")
def patched_probes(patched_site) -> dict:
    """Probe results from the patched wheel installed in the scratch venv."""
    return run_probes(patched_site)


@pytest.fixture(scope="session")
def bw() -> ModuleType:
    return load_script(REPO / "distro" / "build_wheel.py", "sglang_offload_build_wheel")


@pytest.fixture(scope="session")
def apply_mod() -> ModuleType:
    return load_script(REPO / "distro" / "apply_patch.py", "sglang_offload_apply_patch")


@pytest.fixture(scope="session")
def pinned_wheel(bw) -> Path:
    pin = bw.load_pin()
    return bw.fetch_wheel(pin, bw.pick_wheel(pin))


@pytest.fixture(scope="session")
def built_wheel(bw, pinned_wheel, tmp_path_factory) -> Path:
    return bw.build(tmp_path_factory.mktemp("dist"), from_file=pinned_wheel)


@pytest.fixture(scope="session")
def patched_site(built_wheel, tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-compile", "--disable-pip-version-check", "-q", str(built_wheel)],
        check=True,
    )
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    return Path(site)
