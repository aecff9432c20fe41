"""`sglang-offload cache`: stats, verify (a planted bad block), evict, clear, on a real DiskStore,
also while another process writes and evicts in the same directory."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from offload.cli import main
from offload.keys import Namespace
from offload.store.disk.slab.format import HEADER_BYTES, parse_segment_name
from tests.store.stores import open_store

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 64 << 10
NS_A = Namespace(model="meta-llama/Llama-3.1-8B-Instruct", dtype="bfloat16",
                 layout="page_first", page_size=64, tp_rank=0, tp_size=2)
NS_B = Namespace(model="Qwen2.5-72B", dtype="fp8", layout="layer_first", page_size=32, mla=False,
                 salt="tenant-1")


def _fill(d: Path, per_ns: int = 10, capacity: int = 64 << 20) -> dict[bytes, bytes]:
    blocks = {}
    with open_store(d, capacity) as s:
        for ns in (NS_A, NS_B):
            s.register_namespace(ns)
            keys = [ns.key(f"page-{i}") for i in range(per_ns)]
            data = [os.urandom(BLOCK) for _ in keys]
            assert all(s.put_many(keys, [[b] for b in data]))
            blocks.update(zip(keys, data))
    return blocks


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["cache", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _capacity(d: Path) -> int:
    db = sqlite3.connect(str(d / "index.db"))
    try:
        return int(db.execute("SELECT value FROM meta WHERE name='capacity'").fetchone()[0])
    finally:
        db.close()


def test_stats_text_and_json(tmp_path, capsys):
    d = tmp_path / "cache"
    _fill(d)
    rc, out, _ = _cli(capsys, "stats", str(d))
    assert rc == 0
    assert "blocks     20 (1280KiB of data" in out and "of 64MiB" in out
    assert NS_A.digest().hex() in out and NS_B.digest().hex() in out
    assert "meta-llama/Llama-3.1-8B-Instruct, bfloat16, layout page_first, page 64, tp 0/2" in out
    assert "salted" in out and "tenant-1" not in out        # the salt itself is never shown
    assert "hit rate   not recorded in the directory" in out
    rc, out, _ = _cli(capsys, "stats", "--json", str(d))
    s = json.loads(out)
    assert s["blocks"] == 20 and s["data_bytes"] == 20 * BLOCK and s["capacity"] == 64 << 20
    assert {n["digest"]: n["blocks"] for n in s["namespaces"]} == {
        NS_A.digest().hex(): 10, NS_B.digest().hex(): 10}
    assert s["oldest"] <= s["newest"] <= time.time()
    assert _capacity(d) == 64 << 20                          # opening kept the directory's cap


def test_stats_and_verify_of_a_fresh_drive_directory(tmp_path, capsys):
    """A cache directory made as deploy/drives.md says (`mkdir -m 700`), before any server used
    it: `cache stats` and `cache verify` say it is empty (exit 0) and create nothing in it; beside
    a used drive, the totals are that drive's."""
    fresh = tmp_path / "fresh"
    fresh.mkdir(mode=0o700)
    rc, out, err = _cli(capsys, "stats", str(fresh))
    assert rc == 0, err
    assert f"cache {fresh}" in out and "no cache written here yet" in out
    rc, out, _ = _cli(capsys, "stats", "--json", str(fresh))
    s = json.loads(out)
    assert rc == 0 and s["fresh"] and s["blocks"] == 0 and s["namespaces"] == []
    rc, out, _ = _cli(capsys, "verify", str(fresh))
    assert rc == 0 and "checked 0 blocks: 0 bad" in out
    assert os.listdir(fresh) == []                           # looked at, never written
    used = tmp_path / "used"
    _fill(used)
    rc, out, _ = _cli(capsys, "stats", "--json", str(used), str(fresh))
    s = json.loads(out)
    assert rc == 0 and s["blocks"] == 20 and s["failed"] == []
    assert os.listdir(fresh) == []
    rc, _, err = _cli(capsys, "stats", str(tmp_path / "missing"))
    assert rc == 2 and "no such directory" in err            # a typo is still an error
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a cache")
    rc, _, err = _cli(capsys, "stats", str(tmp_path / "other"))
    assert rc == 2 and "not a cache directory" in err        # and so is a directory of files


def test_verbose_stats_and_clear_log_what_they_read_and_do(tmp_path, capsys, caplog):
    d = tmp_path / "cache"
    _fill(d, per_ns=2)
    with caplog.at_level("DEBUG", logger="offload"):
        assert main(["-v", "cache", "stats", str(d)]) == 0
        assert main(["-v", "cache", "clear", str(d), "--namespace", NS_A.digest().hex()]) == 0
    capsys.readouterr()
    debug = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "DEBUG")
    assert f"read from {d / 'index.db'}" in debug
    assert ": 4 blocks, " in debug and "2 namespace(s)" in debug
    assert f"namespace {NS_B.digest().hex()}: 2 blocks" in debug
    assert f"clearing {NS_A.digest().hex()} of {d} (2 blocks)" in debug


def test_stats_hit_rates_from_a_metrics_endpoint(tmp_path, capsys):
    from prometheus_client import CollectorRegistry, start_http_server

    from offload.metrics import TierMetrics

    reg = CollectorRegistry()
    m = TierMetrics(reg)
    m.hits.labels("local").inc(30)
    m.misses.labels("local").inc(10)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=reg)
    try:
        d = tmp_path / "cache"
        _fill(d, per_ns=1)
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        rc, out, _ = _cli(capsys, "stats", str(d), "--metrics-url", url)
        assert rc == 0 and "hit rate   local: 75.0% (30 hits, 10 misses" in out
        rc, out, _ = _cli(capsys, "stats", "--json", str(d), "--metrics-url", url)
        assert json.loads(out)["hit_rates"]["local"]["hit_rate"] == 0.75
    finally:
        server.shutdown()
        thread.join()


def test_stats_on_a_page_that_is_not_prometheus_text(tmp_path, capsys):
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<html><body>{not: metrics} x y z</body></html>\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        d = tmp_path / "cache"
        _fill(d, per_ns=1)
        url = f"http://127.0.0.1:{server.server_port}/"
        rc, out, err = _cli(capsys, "stats", str(d), "--metrics-url", url)
        assert rc == 1 and out == "" and err.startswith(f"error: --metrics-url {url}: not "
                                                        "Prometheus text")
        assert len(err.splitlines()) == 1
    finally:
        server.shutdown()
        thread.join()


def test_clear_of_a_namespace_the_directory_does_not_hold(tmp_path, capsys):
    d = tmp_path / "cache"
    _fill(d, per_ns=1)
    rc, out, err = _cli(capsys, "clear", str(d), "--namespace", "ab" * 16)
    assert rc == 2 and out == "" and "no such namespace" in err
    assert NS_A.digest().hex() in err and NS_B.digest().hex() in err     # the ones it holds
    rc, out, _ = _cli(capsys, "stats", "--json", str(d))
    assert json.loads(out)["blocks"] == 2                                  # nothing deleted


def _flip_data_byte(d: Path, which: int = 3) -> None:
    """Flip one byte in the data region (past the slot header) of the `which`-th slot."""
    slab = next(p for p in sorted(d.iterdir()) if parse_segment_name(p.name))
    _, slot_bytes = parse_segment_name(slab.name)
    with open(slab, "r+b") as f:
        off = which * slot_bytes + HEADER_BYTES + 1234
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x5A]))


def test_verify_finds_deletes_and_reports_a_planted_bad_block(tmp_path, capsys):
    d = tmp_path / "cache"
    blocks = _fill(d)
    rc, out, _ = _cli(capsys, "verify", str(d))
    assert rc == 0 and "checked 20 blocks: 0 bad" in out
    _flip_data_byte(d)
    rc, out, _ = _cli(capsys, "verify", "--json", str(d))
    v = json.loads(out)
    assert rc == 1 and v["checked"] == 20 and len(v["bad"]) == 1
    bad = v["bad"][0]
    assert bad["reason"] == "corrupt: checksum mismatch" and bad["deleted"] is True
    rc, out, _ = _cli(capsys, "verify", str(d))
    assert rc == 0 and "checked 19 blocks: 0 bad" in out
    with open_store(d, 64 << 20) as s:
        keys = list(blocks)
        got = [bytearray(BLOCK) for _ in keys]
        ok = s.get_many(keys, [[g] for g in got])
        assert [k.hex() for k, o in zip(keys, ok) if not o] == [bad["key"]]
        assert all(bytes(g) == blocks[k] for k, g, o in zip(keys, got, ok) if o)


def test_verify_text_output_names_the_bad_block(tmp_path, capsys):
    d = tmp_path / "cache"
    _fill(d, per_ns=2)
    _flip_data_byte(d, which=0)
    rc, out, _ = _cli(capsys, "verify", str(d))
    assert rc == 1
    assert "corrupt: checksum mismatch (deleted)" in out
    assert "checked 4 blocks: 1 bad, 1 deleted" in out


WRITER = """
import os, sys, time
from offload.config import Size, StoreConfig
from offload.store.disk.store import DiskStore
s = DiskStore(StoreConfig(path=sys.argv[1], capacity=Size(int(sys.argv[2])), min_free=Size(0)))
print("ready", flush=True)
i, end = 0, time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    keys = [b"W" * 16 + (i + j).to_bytes(16, "big") for j in range(8)]
    s.put_many(keys, [[os.urandom(65536)] for _ in keys])
    i += 8
s.close()
print(i, flush=True)
"""


def test_verify_while_another_process_writes_and_evicts(tmp_path, capsys):
    d = tmp_path / "cache"
    _fill(d, per_ns=20, capacity=4 << 20)           # at the cap: the writer evicts as it goes
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    w = subprocess.Popen([sys.executable, "-c", WRITER, str(d), str(4 << 20), "4"], env=env,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert w.stdout is not None and w.stdout.readline().strip() == "ready"
        for _ in range(3):
            rc, out, _ = _cli(capsys, "verify", "--json", str(d))
            assert rc == 0 and json.loads(out)["bad"] == [], out
    finally:
        w.wait(timeout=60)
    assert w.returncode == 0


def test_evict_and_clear(tmp_path, capsys):
    d = tmp_path / "cache"
    _fill(d)
    rc, out, _ = _cli(capsys, "evict", str(d), "--to", "600KiB")
    assert rc == 0 and out.startswith("evicted ")
    with open_store(d, 64 << 20) as s:
        assert s.stats().bytes_used <= 600 << 10
        left = s.stats().blocks
    rc, out, _ = _cli(capsys, "stats", "--json", str(d))
    per_ns = {n["digest"]: n["blocks"] for n in json.loads(out)["namespaces"]}
    rc, out, _ = _cli(capsys, "clear", str(d), "--namespace", NS_B.digest().hex())
    assert rc == 0 and out == f"deleted {per_ns[NS_B.digest().hex()]} blocks of namespace " \
                              f"{NS_B.digest().hex()}\n"
    rc, out, _ = _cli(capsys, "stats", "--json", str(d))
    s = json.loads(out)
    assert s["blocks"] == left - per_ns[NS_B.digest().hex()]
    rc, _, err = _cli(capsys, "clear", str(d), "--all")        # no terminal to ask: refused
    assert rc == 2 and "--yes" in err and "nothing deleted" in err
    rc, out, _ = _cli(capsys, "stats", "--json", str(d))
    assert json.loads(out)["blocks"] == s["blocks"]
    rc, out, _ = _cli(capsys, "clear", str(d), "--all", "--yes")
    assert rc == 0
    rc, out, _ = _cli(capsys, "stats", "--json", str(d))
    assert json.loads(out)["blocks"] == 0
    assert _capacity(d) == 64 << 20


@pytest.mark.parametrize("argv,message", [
    (["evict", "{d}", "--to", "lots"], "--to: 'lots'"),
    (["clear", "{d}", "--namespace", "xyz"], "32-digit hex digest"),
    (["clear", "{d}", "--namespace", "00ff"], "32-digit hex digest"),
    (["stats", "{missing}"], "not a cache directory"),
])
def test_bad_input_is_exit_2_with_a_message(tmp_path, capsys, argv, message):
    d = tmp_path / "cache"
    _fill(d, per_ns=1)
    rc, _, err = _cli(capsys, *[a.format(d=d, missing=tmp_path / "nope") for a in argv])
    assert rc == 2 and message in err
    assert not (tmp_path / "nope").exists()
