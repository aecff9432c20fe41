"""Before `launch` starts SGLang: can SGLang's page-hash extension be built and loaded there?

SGLang's HiCache L3 names pages with `hicache_hash_cpp`, a C++ extension torch JIT-builds once and
loads in each process (`offload.hicache.native_hash`). The backend builds or loads it when SGLang
registers the host pool, before the server answers, so no request pays it; this module is the
launch-side check, run in launch's own process with the environment SGLang will get:

- `built_library(env) -> Path | None`: a build of the extension already in torch's extensions
  directory (`TORCH_EXTENSIONS_DIR`, else `$XDG_CACHE_HOME` or `~/.cache` + `torch_extensions/*/`).
- `check_native_hash(env) -> str`: one line for launch's log (built already, or built at start),
  or `RunError` when ninja is missing (torch runs it on every load) or, with nothing built yet, the
  C++ compiler: named, with the fix, before SGLang starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from offload.errors import RunError
from offload.hicache.native_hash import FIX, NAME, missing_build_tools


def _roots(env: Mapping[str, str]) -> list[Path]:
    if env.get("TORCH_EXTENSIONS_DIR"):
        return [Path(env["TORCH_EXTENSIONS_DIR"])]
    cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else (
        Path(env.get("HOME") or Path.home()) / ".cache")
    base = cache / "torch_extensions"
    return sorted(p for p in base.glob("*") if p.is_dir()) if base.is_dir() else []


def built_library(env: Mapping[str, str]) -> Path | None:
    """A built `hicache_hash_cpp.so` under torch's extensions directory for `env`, if any."""
    for root in _roots(env):
        lib = root / NAME / f"{NAME}.so"
        if lib.is_file():
            return lib
    return None


def check_native_hash(env: Mapping[str, str]) -> str:
    """The log line for SGLang's page-hash extension, or RunError naming the missing tools."""
    lib = built_library(env)
    missing = missing_build_tools(env, compiler=lib is None)
    if missing:
        need = "loads" if lib is not None else "builds and loads"
        raise RunError(f"SGLang's HiCache L3 hashes pages with its {NAME} extension, which torch "
                       f"{need} with ninja and a C++ compiler; not on PATH: {', '.join(missing)}; "
                       f"{FIX}")
    if lib is not None:
        return (f"page-hash extension {NAME}: built ({lib}); the backend loads it at start, "
                "before SGLang answers")
    return (f"page-hash extension {NAME}: not built yet; the backend builds it once at start, "
            "before SGLang answers (tens of seconds on a small CPU)")
