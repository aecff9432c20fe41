"""`bench serve` when the restart fails: the rows measured before it are reported with the
failure named, and the command exits 1 (they were dropped before).

The first server is a loopback stand-in that answers SGLang's HTTP API (`/model_info`,
`/get_server_info`, streaming `/generate`) with the cache report a real one gives; the restart is
a real process that exits at once, as SGLang does when it refuses a start ("Not enough host
memory"). `LaunchedServer.start` is the one seam replaced.
"""

from __future__ import annotations

import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

from offload import cli
from offload.bench import serve, serve_target
from offload.launch.server import LaunchedServer

PAGE = 64
INFO = {"model_path": "/m", "attention_backend": "torch_native", "device": "cpu",
        "page_size": PAGE, "context_length": 4096}


class _SGLang(BaseHTTPRequestHandler):
    """SGLang's answers: a prompt seen before is cached to its last full page."""

    seen: set[tuple[int, ...]] = set()

    def log_message(self, *_a: Any) -> None:
        pass

    def _json(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._json(INFO)

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids = tuple(req["input_ids"])
        cached = (len(ids) - 1) // PAGE * PAGE if ids in self.seen else 0
        self.seen.add(ids)
        meta = {"prompt_tokens": len(ids), "cached_tokens": cached,
                "cached_tokens_details": {"device": cached}}
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        tokens = [[-0.1, 7, None], [-0.2, 8, None]]          # what REQUEST asks for, streamed
        tops = [[[-0.1, 7, None], [-2.0, 9, None]], [[-0.2, 8, None], [-2.5, 9, None]]]
        for k in (1, 2):
            chunk = {"text": "ab"[:k], "output_ids": [7, 8][:k],
                     "meta_info": {**meta, "completion_tokens": k,
                                   "output_token_logprobs": tokens[:k],
                                   "output_top_logprobs": tops[:k]}}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def stand_in() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _SGLang)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_failed_restart_keeps_the_rows_and_names_the_failure(
        tmp_path: Path, stand_in: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    starts: list[Path] = []

    def start(config: Path, log: Path, url: str, **_kw: Any) -> LaunchedServer:
        starts.append(Path(log))
        if len(starts) == 1:
            return LaunchedServer.at(stand_in)
        with open(log, "ab") as out:     # SGLang refusing the start
            proc = subprocess.Popen(["sh", "-c", "echo 'RuntimeError: Not enough host memory "
                                     "available.'; exit 1"], stdout=out, stderr=subprocess.STDOUT)
        return LaunchedServer(url, proc, Path(log))

    monkeypatch.setattr(serve.LaunchedServer, "start", staticmethod(start))
    monkeypatch.setattr(serve, "wait_store", lambda *_a, **_k: 0)      # no store to watch
    monkeypatch.setattr(serve_target, "wait_store", lambda *_a, **_k: 0)
    monkeypatch.setattr(serve_target, "SETTLE_S", 0.0)
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text("sglang: {model-path: /m}\n")
    rc = cli.main(["bench", "serve", "--config", str(cfg), "--dir", str(tmp_path), "--lengths",
                   "256,512", "--repeat", "2", "--json"])
    out, err = capsys.readouterr()
    assert rc == 1 and len(starts) == 2, err
    result = json.loads(out[out.index("{\n"):])
    assert result["l3_failed"].startswith("the server exited with 1 before it answered")
    for n in ("256", "512"):
        row = result["rows"][n]
        assert row["cold"]["cached_tokens"] == 0 and len(row["cold"]["ttft_tries_s"]) == 2
        assert row["l1l2"]["cached_tokens"] == (int(n) - 1) // PAGE * PAGE
        assert row["l3_failed"] == result["l3_failed"] and "target" not in row
    assert "L3 at 512 tokens: FAILED, the server exited with 1" in out
    assert "Not enough host memory" in err          # the restarted server's log, shown
