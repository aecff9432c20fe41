"""The Python side of each path (offload/hw/pyside.py, live.python_query), asked of stand-in
interpreters under tests/fixtures/pythons/ (the machine's python3 -S with stub packages) and of
this one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from offload.cli import main
from offload.config import load_offload
from offload.hw import PathRejectedError, decide, detect, detect_and_decide
from offload.hw.live import Live, PyModule, PythonReport, python_query
from offload.hw.pyside import checkout, extra_for_cuda, path_python
from tests.hw.hw_schema_check import validate

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
HOSTS, PYTHONS = FIXTURES / "hosts", FIXTURES / "pythons"
SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "offload/hw/schema.json").read_text())
AGENT = {"agent": {"address": "10.0.0.2:7070"}}
CHECKOUT = checkout()   # installed editable, as docs/install.md says


def pip_extra(extra: str) -> str:
    return f"-m pip install -e '{CHECKOUT}[{extra}]'"


def report(torch_cuda: str | None = "13.0", **found: str) -> PythonReport:
    """A report whose modules are `name="dist version"` (torch always, at 2.11.0)."""
    mods = [PyModule("torch", True, "torch", "2.11.0")]
    mods += [PyModule(n, True, *v.split()) for n, v in found.items()]
    return PythonReport("/opt/py", "ok", "Python 3.12.3", "3.12.3", torch_cuda, tuple(mods))


def test_the_probe_imports_nothing_and_reads_torch_cuda_off_disk() -> None:
    r = python_query(str(PYTHONS / "all-cu13"))
    assert r.status == "ok" and r.torch_cuda == "13.0"
    mods = {m.name: m for m in r.modules}
    assert (mods["kvikio"].found, mods["kvikio"].dist) == (True, "kvikio-cu13")
    assert mods["nixl_cu12"].found is False
    # the stubs' __init__ never ran: no __pycache__ was written next to them
    assert not list((PYTHONS / "site").rglob("__pycache__"))


def test_this_interpreter_answers() -> None:
    r = python_query(sys.executable)
    assert r.status == "ok" and r.python == sys.version.split()[0]
    assert {m.name for m in r.modules} >= {"kvikio", "nixl", "msgspec", "redis", "torch"}


def test_an_interpreter_that_does_not_run_rejects_gds_and_dpu(tmp_path: Path) -> None:
    r = python_query(str(tmp_path / "no-such-python"))
    assert r.status == "unavailable" and "did not run" in r.reason
    for path in ("gds", "dpu"):
        p = path_python(r, path)
        assert p.present is False and "--python" in p.fix


@pytest.mark.parametrize("cuda,extra", [("13.0", "gds-cu13"), ("12.9", "gds-cu12"),
                                        (None, "gds-cu13")])
def test_gds_extra_follows_torch_cuda(cuda: str | None, extra: str) -> None:
    assert extra_for_cuda(cuda) == extra
    p = path_python(report(cuda), "gds")
    assert p.present is False and p.fix == f"/opt/py {pip_extra(extra)}"


def test_gds_kvikio_cuda_major_must_match_torch() -> None:
    assert path_python(report("13.0", kvikio="kvikio-cu13 26.10.0"), "gds").present is True
    bad = path_python(report("12.9", kvikio="kvikio-cu13 26.10.0"), "gds")
    assert bad.present is False and "built for CUDA 13 but torch for CUDA 12.9" in bad.detail
    assert bad.fix.endswith(pip_extra("gds-cu12"))
    cpu_torch = path_python(report(None, kvikio="kvikio-cu13 26.10.0"), "gds")
    assert cpu_torch.present is True and "not compared" in cpu_torch.detail


def test_dpu_needs_nixl_with_torch_s_backend_over_ucx_only() -> None:
    base = {"msgspec": "msgspec 0.20.0", "nixl": "nixl 1.5.1"}
    assert path_python(report(nixl_cu13="nixl-cu13 1.5.1", **base), "dpu").present is True
    wrong = path_python(report(nixl_cu12="nixl-cu12 1.5.1", **base), "dpu")
    assert wrong.present is False and "nixl_cu13 missing" in wrong.detail
    no_nixl = report(msgspec="msgspec 0.20.0")
    assert path_python(no_nixl, "dpu").present is False
    assert path_python(no_nixl, "dpu", transport="tcp").present is True


def test_fixture_dpu_host_rejects_dpu_without_nixl_and_uses_the_next_path() -> None:
    facts, d = detect_and_decide(load_offload(AGENT), root=str(HOSTS / "h100-bf3-dpu"),
                                 python=str(PYTHONS / "bare"))
    assert d.path == "cpu"
    dpu = next(r for r in d.rejected if r.path == "dpu")
    assert dpu.check.startswith("python: msgspec is not importable")
    assert dpu.fix.endswith(pip_extra("dpu"))
    cfg = load_offload({**AGENT, "transfer": {"path": "dpu"}})
    with pytest.raises(PathRejectedError) as e:
        decide(detect(cfg, root=str(HOSTS / "h100-bf3-dpu"), python=str(PYTHONS / "bare")), cfg)
    assert e.value.check.startswith("python:")


def test_injected_python_probe_stands_in() -> None:
    """live.python is injectable: a fixture can answer without running anything."""
    calls = []

    def fake(exe: str, timeout: float) -> PythonReport:
        calls.append(exe)
        return report("13.0", kvikio="kvikio-cu13 26.10.0")
    facts, d = detect_and_decide(load_offload({}), root=str(HOSTS / "h100x8-gds"),
                                 cache_dir="/raid/kv", live=Live(python=fake), python="/opt/py")
    assert calls == ["/opt/py"] and d.path == "gds"
    assert any(r.startswith("gds: kvikio-cu13 26.10.0 for CUDA 13") for r in d.reasons)
    _, d = detect_and_decide(load_offload({}), root=str(HOSTS / "h100x8-gds"),
                             cache_dir="/raid/kv", live=Live())
    assert d.path == "gds" and any(r.startswith("assumed: python passes") for r in d.reasons)


@pytest.mark.parametrize("python", ["all-cu13", "bare"])
def test_detect_json_reports_each_path_s_python_side(python: str, capsys) -> None:
    rc = main(["detect", "--root", str(HOSTS / "h100x8-gds"), "--cache-dir", "/raid/kv",
               "--python", str(PYTHONS / python), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and validate(out, SCHEMA) == []
    side = out["facts"]["python"]
    assert side["executable"] == str(PYTHONS / python) and side["status"] == "ok"
    present = {p["path"]: p["present"] for p in side["paths"]}
    assert present == dict.fromkeys(("gds", "dpu", "redis", "metrics"), python == "all-cu13")
    assert out["facts"]["gds"]["status"] == "available"     # the machine's side is unchanged
    assert out["decision"]["path"] == ("gds" if python == "all-cu13" else "cpu")


def test_redis_url_without_redis_py_is_an_error_in_detect(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "r.yaml"
    cfg.write_text("offload:\n  redis:\n    url: redis://127.0.0.1:6379/0\n")
    rc = main(["detect", "--root", str(HOSTS / "cpu-box"), "--config", str(cfg), "--json",
               "--python", str(PYTHONS / "bare")])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and validate(out, SCHEMA) == []
    assert out["error"]["path"] == "redis" and out["error"]["check"].startswith("python: redis")
