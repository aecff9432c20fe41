"""The Grafana dashboard proven against a real Prometheus and a real server.

A server launched through `sglang-offload launch` with SGLang's metrics on (`--enable-metrics`)
and our own port (`offload.metrics.port`); Debian's `prometheus` (installed by
scripts/install.sh) on loopback scrapes SGLang's `/metrics` for `sglang:*` and our port for
`sglang_offload_*` every second (docs/reference/metrics.md's scrape config); a short workload:
a cold prompt, the same again (from L1), then again after SGLang's `/flush_cache` emptied L1/L2
(from L3). Then every panel's PromQL in grafana/sglang-offload.json, evaluated through
Prometheus's HTTP API, returns data, and Prometheus's cached tokens by tier equal what the
requests reported (`cached_tokens_details`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest

from offload.launch.server import LaunchedServer, free_port, wait_store
from tests.e2e.conftest import PAGE, flush_l1_l2, full_pages, needs_serving, prompt

pytestmark = [needs_serving, pytest.mark.timeout(1200), pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="Debian's prometheus is not installed: run `bash scripts/install.sh`")]
DASHBOARD = Path(__file__).resolve().parents[2] / "grafana" / "sglang-offload.json"

SCRAPE = """global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: sglang
    static_configs: [{{targets: ["{sglang}"]}}]
    metric_relabel_configs:
      - {{source_labels: [__name__], regex: "sglang:.*", action: keep}}
  - job_name: sglang-offload
    static_configs: [{{targets: ["{ours}"]}}]
    metric_relabel_configs:
      - {{source_labels: [__name__], regex: "sglang_offload_.*", action: keep}}
"""


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


class Prometheus:
    def __init__(self, tmp: Path, sglang: str, ours: str):
        self.port = free_port()
        cfg = tmp / "prometheus.yml"
        cfg.write_text(SCRAPE.format(sglang=sglang, ours=ours))
        self.log = tmp / "prometheus.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(self.url + "/-/ready", timeout=5).read()
                return
            except OSError as exc:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise AssertionError(self.log.read_text()[-3000:]) from exc
                time.sleep(0.5)

    def query(self, expr: str) -> list[dict]:
        got = _get(self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert got["status"] == "success", (expr, got)
        return got["data"]["result"]

    def value(self, expr: str) -> dict[str, float]:
        return {json.dumps(r["metric"], sort_keys=True): float(r["value"][1])
                for r in self.query(expr)}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def test_every_panel_returns_data_and_cached_tokens_agree_with_the_requests(
        servers: Callable[..., LaunchedServer], tmp_path: Path) -> None:
    ours = free_port()
    store = tmp_path / "store"
    s = servers(store, name="metrics", metrics={"enabled": True, "port": ours})
    host = s.url.removeprefix("http://")
    prom = Prometheus(tmp_path, host, f"127.0.0.1:{ours}")
    try:
        text = prompt(700, 11)
        replies = [s.generate(text)]
        replies.append(s.generate(text))                      # L1
        pages = full_pages(replies[0].prompt_tokens) // PAGE
        assert wait_store(store, pages) >= pages
        flush_l1_l2(s)
        replies.append(s.generate(text))                      # L3
        assert replies[2].details.get("storage", 0) > 0, [r.details for r in replies]
        want = {src: sum(int(r.details.get(src, 0)) for r in replies)
                for src in ("device", "host", "storage")}
        deadline = time.monotonic() + 180                     # our gauges refresh every 10 s
        while True:
            # SGLang's own request metrics (sglang:*) are checked where its /metrics has them
            sglang_up = bool(prom.query('count({__name__=~"sglang:.*"})'))
            got = {json.loads(k)["cache_source"]: v for k, v in
                   prom.value("sum by (cache_source) (sglang:cached_tokens_total)").items()}
            blank = [(t, e) for t, e in exprs() if (sglang_up or "sglang:" not in e)
                     and not prom.query(e.replace("$__rate_interval", "5m"))]
            agree = not sglang_up or all(got.get(k, 0) == v for k, v in want.items() if v)
            hits = sum(prom.value('sum(sglang_offload_hits_total{tier="local"})').values())
            agree = agree and hits * PAGE >= want["storage"]   # the watcher adds hits every 10 s
            if (agree and not blank) or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert not blank, f"panels without data: {blank}"
        if sglang_up:
            assert {k: v for k, v in got.items() if v} == {k: v for k, v in want.items() if v}
        else:
            print("SGLang's /metrics carried no sglang:* series here: its panel not checked")
        assert hits * PAGE >= want["storage"] > 0           # every L3 token came through a hit
        assert sum(prom.value("sum(sglang_offload_load_page_seconds_count)").values()) >= 1
    finally:
        prom.stop()
