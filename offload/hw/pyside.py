"""The Python side of each path: what the interpreter that will run SGLang can import.

Primitives:
- `probe_python(live, executable) -> PythonSide`: asks `live.python` (see live.py: find_spec +
  metadata in a child process, nothing imported) and judges every path with `path_python`.
- `path_python(report, path, transport="ucx") -> PathPython`: gds needs kvikio built for torch's
  CUDA major (`kvikio-cu13` with a CUDA 13 torch); dpu needs msgspec, and over ucx NIXL with the
  backend for torch's CUDA major; redis needs redis-py; metrics prometheus-client. A missing part
  names the `pip install` that adds it, run by that interpreter: the extra of this project,
  installed from its checkout as docs/install.md does (`EXE -m pip install -e 'CHECKOUT[dpu]'`).
- `extra_for_cuda(cuda)`: the gds extra for a CUDA version (`gds-cu13`, `gds-cu12`).
Pure, apart from `live.python`.
"""

from __future__ import annotations

import functools
import os
import re

from offload.hw.facts import PathPython, PythonSide
from offload.hw.live import NOT_CHECKED, Live, PythonReport

PATHS = ("gds", "dpu", "redis", "metrics")
DEFAULT_CUDA_MAJOR = 13  # the pinned SGLang image's CUDA (v0.5.23: CUDA 13)


def cuda_major(version: str | None) -> int | None:
    m = re.match(r"\s*(\d+)", version or "")
    return int(m.group(1)) if m else None


def extra_for_cuda(cuda: str | None) -> str:
    return f"gds-cu{cuda_major(cuda) or DEFAULT_CUDA_MAJOR}"


def _mod(report: PythonReport, name: str) -> tuple[bool, str]:
    for m in report.modules:
        if m.name == name:
            what = f"{m.dist} {m.version}" if m.dist else f"{name} (no package metadata)"
            return m.found, what
    return False, name


@functools.cache
def checkout() -> str:
    """The sglang-offload checkout this package was installed from (editable), else a placeholder."""
    top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return top if os.path.isfile(os.path.join(top, "pyproject.toml")) else "<sglang-offload checkout>"


def _pip(report: PythonReport, what: str) -> str:
    return f"{report.executable} -m pip install {what}"


def _extra(report: PythonReport, extra: str) -> str:
    """The install of one of this project's extras, from its checkout (docs/install.md)."""
    return _pip(report, f"-e '{checkout()}[{extra}]'")


def _torch(report: PythonReport) -> str:
    ok, what = _mod(report, "torch")
    if not ok:
        return "torch is not installed"
    return f"{what} (CUDA {report.torch_cuda or 'none: a CPU build'})"


def path_python(report: PythonReport, path: str, transport: str = "ucx") -> PathPython:
    exe = report.executable
    if report.status == NOT_CHECKED:
        return PathPython(path, None, f"the Python side of {path} was {NOT_CHECKED}", "")
    if report.status != "ok":
        return PathPython(path, False, f"cannot ask the interpreter that runs SGLang: "
                          f"{report.reason}", "pass --python EXE: the interpreter that runs SGLang")
    torch_major = cuda_major(report.torch_cuda)
    if path == "gds":
        extra = extra_for_cuda(report.torch_cuda)
        ok, what = _mod(report, "kvikio")
        if not ok:
            return PathPython(path, False, f"kvikio is not importable by {exe}; "
                              f"{_torch(report)}", _extra(report, extra))
        m = re.search(r"-cu(\d+)$", what.split()[0])
        built = int(m.group(1)) if m else None
        if built is not None and torch_major is not None and built != torch_major:
            return PathPython(path, False, f"{what} is built for CUDA {built} but torch for CUDA "
                              f"{report.torch_cuda} ({exe})",
                              f"{exe} -m pip uninstall -y kvikio-cu{built} libkvikio-cu{built} && "
                              + _extra(report, extra))
        if built is None or torch_major is None:
            return PathPython(path, True, f"{what} importable; CUDA major not compared "
                              f"({_torch(report)})", "")
        return PathPython(path, True, f"{what} for CUDA {built}, as {_torch(report)}", "")
    if path == "dpu":
        fix = _extra(report, "dpu")
        ok, what = _mod(report, "msgspec")
        if not ok:
            return PathPython(path, False, f"msgspec is not importable by {exe}", fix)
        if transport != "ucx":
            return PathPython(path, True, f"{what} importable (transport {transport}: no NIXL)",
                              "")
        ok, nixl = _mod(report, "nixl")
        if not ok:
            return PathPython(path, False, f"NIXL (module nixl) is not importable by {exe}", fix)
        backends = [f"nixl_cu{torch_major}"] if torch_major else ["nixl_cu13", "nixl_cu12"]
        found = [b for b in backends if _mod(report, b)[0]]
        if not found:
            return PathPython(path, False, f"{nixl} has no backend for torch's CUDA "
                              f"({' or '.join(backends)} missing; {_torch(report)})",
                              _pip(report, f"'nixl[cu{torch_major or DEFAULT_CUDA_MAJOR}]'"))
        return PathPython(path, True, f"{nixl} importable with {_mod(report, found[0])[1]}, "
                          f"{what}", "")
    module, extra = {"redis": ("redis", "redis"),
                     "metrics": ("prometheus_client", "metrics")}[path]
    ok, what = _mod(report, module)
    if not ok:
        return PathPython(path, False, f"{module} is not importable by {exe}",
                          _extra(report, extra))
    return PathPython(path, True, f"{what} importable", "")


def probe_python(live: Live, executable: str, transport: str = "ucx") -> PythonSide:
    if live.python is None:
        report = PythonReport(executable, NOT_CHECKED, f"{executable}: {NOT_CHECKED}")
        source = NOT_CHECKED
    else:
        report = live.python(executable, 30.0)
        source = f"{executable} -c (importlib.util.find_spec, importlib.metadata)"
    mods = {m.name: (f"{m.dist or m.name} {m.version or ''}".strip() if m.found else None)
            for m in report.modules}
    torch = mods.get("torch")
    return PythonSide(executable=executable, status=report.status, python=report.python,
                      torch=torch.split()[-1] if torch else None, torch_cuda=report.torch_cuda,
                      modules=mods, paths=tuple(path_python(report, p, transport) for p in PATHS),
                      source=source, reason=report.reason)
