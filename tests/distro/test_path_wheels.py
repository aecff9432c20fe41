"""distro/path_wheels.py: which of pip's resolution the image installs (no network here: the
report is written by hand in pip's --report format)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("path_wheels", REPO / "distro" / "path_wheels.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["path_wheels"] = mod
    spec.loader.exec_module(mod)
    return mod


pw = _load()


def item(name: str, version: str, *requires: str) -> dict:
    return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)}}


REPORT = [
    item("kvikio-cu13", "26.10.0", "cupy-cuda13x[ctk]>=14.0.1", "libkvikio-cu13==26.10.*",
         "numpy<3,>=2", "pytest; extra == 'test'"),
    item("cupy-cuda13x", "14.0.1", "fastrlock>=0.5", "cuda-toolkit[cublas]==13.*; extra == 'ctk'"),
    item("fastrlock", "0.8"),
    item("libkvikio-cu13", "26.10.0", "cuda-toolkit[cufile]==13.*", "rapids-logger==0.3.*"),
    item("cuda-toolkit", "13.0.2", "nvidia-cufile==1.15.*; extra == 'cufile'",
         "nvidia-cublas==13.*; extra == 'cublas'"),
    item("nvidia-cufile", "1.15.1"),
    item("nvidia-cublas", "13.1.0"),
    item("rapids-logger", "0.3.0"),
    item("numpy", "2.3.0"),
    item("nixl", "1.5.1", "nixl-cu12==1.5.1", "nixl-cu13==1.5.1"),
    item("nixl-cu12", "1.5.1", "torch", "numpy"),
    item("nixl-cu13", "1.5.1", "torch", "numpy"),
    item("torch", "2.11.0", "sympy"),
    item("sympy", "1.14"),
]


def test_keep_follows_extras_and_leaves_cupy_torch_and_the_other_cuda_out() -> None:
    kept, skipped = pw.keep(REPORT, ["kvikio-cu13>=25.10", "nixl>=1.5,<2", "msgspec>=0.18"], 13)
    assert [i["metadata"]["name"] for i in kept] == [
        "cuda-toolkit", "kvikio-cu13", "libkvikio-cu13", "nixl", "nixl-cu13", "numpy",
        "nvidia-cufile", "rapids-logger"]
    assert set(skipped) == {"cupy-cuda13x", "torch", "nixl-cu12"}
    # msgspec is not in the report: the base already holds it, so nothing is fetched for it


def test_requirements_come_from_the_extras_of_the_cuda_major() -> None:
    reqs = pw.requirements(REPO / "pyproject.toml", 13)
    assert reqs[0].startswith("kvikio-cu13") and any(r.startswith("nixl") for r in reqs)
    assert any(r.startswith("redis") for r in reqs) and any(r.startswith("prometheus-client")
                                                             for r in reqs)
    assert pw.requirements(REPO / "pyproject.toml", 12)[0].startswith("kvikio-cu12")
    with pytest.raises(pw.BuildError, match="no extra 'gds-cu11'"):
        pw.requirements(REPO / "pyproject.toml", 11)


def test_cuda_major_must_match_the_base_s_torch() -> None:
    cuda = pw.torch_cuda(sys.executable)
    if cuda is None:
        pytest.skip("this interpreter has no CUDA torch")
    major = int(cuda.split(".")[0])
    assert "built for CUDA" in pw.check_cuda(sys.executable, major)
    with pytest.raises(pw.BuildError, match=f"--build-arg CUDA_MAJOR={major}"):
        pw.check_cuda(sys.executable, major + 1)
