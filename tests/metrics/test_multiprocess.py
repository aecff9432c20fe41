"""Two processes write our metrics in prometheus_client's multiprocess mode (as SGLang's scheduler
processes do under `--enable-metrics`); one scrape of SGLang's own `/metrics` app, and one of our
fallback port, shows both."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("metrics_worker.py")


def _run_workers(tmp_path: Path) -> Path:
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(mp_dir),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(store), tag, str(puts), str(miss)],
                              env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
             for tag, puts, miss in (("a", 3, 1), ("b", 5, 2))]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    return mp_dir


def _value(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{line_start} not in the scrape:\n{text}")


def _check(text: str) -> None:
    assert _value(text, 'sglang_offload_hits_total{tier="local"}') == 8
    assert _value(text, 'sglang_offload_misses_total{tier="local"}') == 3
    assert _value(text, 'sglang_offload_bytes_total{direction="read",tier="local"}') == 8 * 8192
    assert _value(text, 'sglang_offload_bytes_total{direction="write",tier="local"}') == 8 * 8192
    assert _value(text, 'sglang_offload_load_seconds_count{path="cpu"}') == 2
    assert _value(text, 'sglang_offload_path_info{path="cpu"}') == 1
    assert _value(text, 'sglang_offload_capacity_bytes{tier="local"}') == 64 << 20
    assert _value(text, 'sglang_offload_blocks{tier="local"}') in (3, 5, 8)   # latest poll


def test_sglang_metrics_endpoint_shows_both_processes(tmp_path, monkeypatch):
    mp_dir = _run_workers(tmp_path)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(mp_dir))
    from sglang.srt.utils.common import add_prometheus_middleware
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    app = Starlette()
    add_prometheus_middleware(app)     # exactly what SGLang's HTTP server does
    with TestClient(app) as client:
        r = client.get("/metrics")
    assert r.status_code == 200
    _check(r.text)


def test_our_port_serves_every_process(tmp_path):
    mp_dir = _run_workers(tmp_path)
    code = ("import sys,time\nfrom offload.config import MetricsConfig\nfrom offload.metrics "
            "import serve\np = serve(MetricsConfig(port=0 + int(sys.argv[1])), addr='127.0.0.1')\n"
            "print(p, flush=True)\ntime.sleep(60)\n")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(mp_dir), PYTHONPATH=str(ROOT))
    server = subprocess.Popen([sys.executable, "-c", code, str(port)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == str(port)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            text = r.read().decode()
        _check(text)
    finally:
        server.kill()
        server.wait()


def test_serve_without_a_port_does_nothing():
    from offload.config import MetricsConfig
    from offload.metrics import serve

    assert serve(MetricsConfig(port=None)) is None
    assert serve(MetricsConfig(enabled=False, port=9)) is None

