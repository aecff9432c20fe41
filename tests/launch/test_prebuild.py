"""launch checks what SGLang's page-hash extension needs before it starts SGLang.

`check_native_hash` over fixture directories (a built library or none) and a PATH with or without
ninja and a compiler; the real `launch` refusing to start without them (exit 1, nothing exec'd).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from offload.errors import RunError
from offload.launch.prebuild import built_library, check_native_hash
from tests.launch.helpers import REPO, fake_python, write

pytestmark = pytest.mark.slow

BASE = "sglang:\n  model-path: m\n  device: cpu\n"   # m: a HuggingFace id, not looked for


def _bin(tmp_path: Path, *tools: str) -> str:
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    for t in tools:
        (d / t).symlink_to(shutil.which(t) or "/bin/true")
    return str(d)


def _built(tmp_path: Path) -> Path:
    lib = tmp_path / "ext" / "hicache_hash_cpp" / "hicache_hash_cpp.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\x7fELF")
    return lib


def test_a_built_library_needs_only_ninja(tmp_path) -> None:
    lib = _built(tmp_path)
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "PATH": _bin(tmp_path, "ninja")}
    assert built_library(env) == lib
    assert "built (" in check_native_hash(env) and "loads it at start" in check_native_hash(env)


def test_default_directory_is_searched_per_python_and_cuda_tag(tmp_path) -> None:
    lib = tmp_path / "cache" / "torch_extensions" / "py311_cu128" / "hicache_hash_cpp" / \
        "hicache_hash_cpp.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    assert built_library({"XDG_CACHE_HOME": str(tmp_path / "cache")}) == lib
    assert built_library({"HOME": str(tmp_path)}) is None


def test_nothing_built_needs_the_compiler_too(tmp_path) -> None:
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "PATH": _bin(tmp_path, "ninja")}
    with pytest.raises(RunError, match=r"builds and loads .*not on PATH: a C\+\+ compiler: c\+\+"):
        check_native_hash(env)
    env["CXX"] = shutil.which("g++") or "/bin/true"
    assert "not built yet; the backend builds it once at start" in check_native_hash(env)


def _launch(tmp_path: Path, path: str) -> subprocess.CompletedProcess[str]:
    fake = fake_python(tmp_path / "python", 'echo "sglang started: $*"\n')
    cfg = write(tmp_path, BASE + "offload:\n  store: {path: " + str(tmp_path / "c") + "}\n")
    return subprocess.run([sys.executable, "-m", "offload.cli", "launch", "--config", str(cfg),
                           "--python", str(fake)], capture_output=True, text=True, cwd=REPO,
                          timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO), PATH=path,
                                                TORCH_EXTENSIONS_DIR=str(tmp_path / "ext")))


def test_launch_refuses_to_start_sglang_without_ninja(tmp_path) -> None:
    res = _launch(tmp_path, _bin(tmp_path, "g++"))
    assert res.returncode == 1 and "sglang started" not in res.stdout
    assert "error: SGLang's HiCache L3 hashes pages with its hicache_hash_cpp extension" in res.stderr
    assert "not on PATH: ninja (Debian: ninja-build; or pip install ninja)" in res.stderr


def test_launch_says_before_sglang_starts_that_the_backend_builds_it(tmp_path) -> None:
    res = _launch(tmp_path, _bin(tmp_path, "ninja", "c++"))
    assert res.returncode == 0, res.stderr
    assert "page-hash extension hicache_hash_cpp: not built yet" in res.stderr
    assert "sglang started: -m sglang.launch_server" in res.stdout
