"""SGLang's page-hash extension is built once, loaded after, and ready before any request.

Real builds (torch's JIT, g++ and ninja) into a private extensions directory; the missing-tool
errors with a PATH that lacks them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offload.errors import RunError
from offload.hicache import native_hash
from tests.hicache import hicache_pools as hp

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ENSURE = ("import json; from offload.hicache.native_hash import ensure_native_hash; "
          "r = ensure_native_hash(); print(json.dumps({'built': r.built, 'library': str(r.library)}))")


def _ensure(ext_dir: Path) -> dict:
    res = subprocess.run([sys.executable, "-c", ENSURE], capture_output=True, text=True, cwd=REPO,
                         timeout=900, env={**os.environ, "PYTHONPATH": str(REPO),
                                           "TORCH_EXTENSIONS_DIR": str(ext_dir)})
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_built_once_then_loaded_in_each_later_process(tmp_path) -> None:
    first = _ensure(tmp_path / "ext")
    lib = Path(first["library"])
    assert first["built"] and lib == tmp_path / "ext" / "hicache_hash_cpp" / "hicache_hash_cpp.so"
    mtime = lib.stat().st_mtime_ns
    second = _ensure(tmp_path / "ext")            # a restarted server: loads, compiles nothing
    assert not second["built"] and second["library"] == first["library"]
    assert lib.stat().st_mtime_ns == mtime


def test_missing_tools_are_named(tmp_path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    missing = native_hash.missing_build_tools({"PATH": str(empty)})
    assert [m.split(" ")[0] for m in missing] == ["ninja", "a"] and "c++" in missing[1]
    assert native_hash.missing_build_tools({"PATH": str(empty)}, compiler=False) == missing[:1]
    (empty / "ninja").write_text("#!/bin/sh\n")
    (empty / "ninja").chmod(0o755)
    assert native_hash.missing_build_tools({"PATH": str(empty), "CXX": "clang++ -O2"}) == [
        "a C++ compiler: clang++ (CXX, default c++; Debian: g++)"]


def test_ensure_refuses_without_the_tools_and_says_how_to_fix(tmp_path, monkeypatch) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    with pytest.raises(RunError, match=r"not on PATH: ninja .*a C\+\+ compiler: c\+\+ .*install g\+\+"):
        native_hash.ensure_native_hash()


def test_the_backend_loads_it_when_sglang_registers_the_host_pool(tmp_path) -> None:
    from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module

    _load_native_hash_module.cache_clear()
    host = hp.host_pool(hp.device_pool(False), "page_first", pages=4)
    sc = hp.storage_config(hp.extra(str(tmp_path / "store")), layout="page_first")
    b = hp.make_backend(sc, host)
    try:
        assert _load_native_hash_module.cache_info().currsize == 1   # SGLang's next call: cached
    finally:
        b.close()
