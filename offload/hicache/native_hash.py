"""SGLang's page-hash extension, ready before the first request: `ensure_native_hash()`.

SGLang 0.5.23 names every page its HiCache L3 reads or writes by a SHA-256 chain computed in a
C++ extension, `hicache_hash_cpp` (`sglang/srt/mem_cache/cpp_utils/native_hash.py`), which torch
JIT-builds on first use into its extensions directory (`TORCH_EXTENSIONS_DIR`, by default
`~/.cache/torch_extensions/<python>_<cuda>/hicache_hash_cpp`) with ninja and a C++ compiler
(`CXX`, by default `c++`), and loads in every process that hashes (each start runs ninja, a no-op
once built). Left to SGLang, the first request that reaches L3 pays the build (20-66 s on a
2-core VM) or the load.

- `missing_build_tools(env, compiler) -> list[str]`: the tools not on the environment's PATH, each
  with what provides it (`launch` checks this before it starts SGLang:
  `offload.launch.prebuild`).
- `ensure_native_hash() -> NativeHash`: builds or loads the extension in this process (SGLang's own
  loader, cached for the process, so SGLang's later calls find it loaded); the backend calls it
  when SGLang registers the host pool, before the scheduler reports ready. Raises `RunError`
  naming the missing tools, or the build's last lines, and the fix.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from offload.errors import RunError

logger = logging.getLogger(__name__)

NAME = "hicache_hash_cpp"
FIX = ("install g++, ninja-build, libssl-dev and python3-dev (scripts/install.sh does), or set CXX "
       "to a C++ compiler")


@dataclass(frozen=True)
class NativeHash:
    library: Path                 # the built shared object
    built: bool                   # this call compiled it (False: loaded a build already there)
    seconds: float


def missing_build_tools(env: Mapping[str, str] | None = None, compiler: bool = True) -> list[str]:
    """What torch's JIT loader needs and `env`'s PATH lacks (each named with its source): ninja
    always (torch runs it on every load), the compiler only to build (`compiler`)."""
    env = os.environ if env is None else env
    path = env.get("PATH", os.defpath)
    cxx = (env.get("CXX") or "c++").split()[0] if (env.get("CXX") or "").strip() else "c++"
    out = []
    if shutil.which("ninja", path=path) is None:
        out.append("ninja (Debian: ninja-build; or pip install ninja)")
    if compiler and shutil.which(cxx, path=path) is None:
        out.append(f"a C++ compiler: {cxx} (CXX, default c++; Debian: g++)")
    return out


def _build_directory() -> Path:
    from sglang.srt.utils.cpp_extension_loader import _get_build_directory

    return _get_build_directory(NAME)


def _chain(exc: BaseException, lines: int = 6) -> str:
    """The last lines of an exception and its causes (a compiler's error ends torch's message)."""
    text = []
    cur: BaseException | None = exc
    while cur is not None:
        text.extend(str(cur).strip().splitlines())
        cur = cur.__cause__ or cur.__context__
    return " | ".join(ln.strip() for ln in text[-lines:] if ln.strip())


def ensure_native_hash() -> NativeHash:
    """Build (first time) or load SGLang's page-hash extension in this process; RunError if not."""
    from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module

    library = _build_directory() / f"{NAME}.so"
    before = library.stat().st_mtime_ns if library.exists() else None
    missing = missing_build_tools(compiler=before is None)
    if missing:
        raise RunError(f"SGLang's HiCache L3 hashes pages with its {NAME} extension, which torch "
                       f"builds and loads with ninja and a C++ compiler; not on PATH: "
                       f"{', '.join(missing)}; {FIX}")
    t0 = time.perf_counter()
    try:
        module = _load_native_hash_module()
        module.get_hash  # noqa: B018 - the binding SGLang calls is there
    except Exception as e:
        raise RunError(f"SGLang's {NAME} extension did not build or load in "
                       f"{library.parent}: {_chain(e)}; {FIX}") from e
    seconds = time.perf_counter() - t0
    after = library.stat().st_mtime_ns if library.exists() else None
    done = NativeHash(library, after != before, seconds)
    logger.info("offload: SGLang's page-hash extension %s %s in %.2f s (%s)", NAME,
                "built and loaded" if done.built else "loaded", seconds, library)
    return done
