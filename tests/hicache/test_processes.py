"""Several processes on one cache directory: a restart sees what was stored before; two replicas
on one node share blocks. The other process is a fresh interpreter building its own SGLang host
pool and backend (tests/hicache/worker.py, results as JSON); the test process is the second one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.hicache.worker import run

WORKER = os.path.join(os.path.dirname(__file__), "worker.py")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _start(opts: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WORKER, json.dumps(opts)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=150)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_restart_sees_blocks_stored_before(tmp_path):
    d = str(tmp_path / "store")
    first = _result(_start({"dir": d, "write": [[11, 0, 6]],
                            "then": {"mla": True, "layout": "layer_first", "write": [[12, 0, 3]]}}))
    assert first["written"] == [6] and first["then"]["written"] == [3]
    # A new backend in another process (this one) on the same directory.
    assert run({"dir": d, "read": [[11, 6]]})["read"] == [{"exists": 6, "ok": 6, "exact": 6}]
    assert run({"dir": d, "mla": True, "layout": "layer_first", "read": [[12, 3]]})["read"] == \
        [{"exists": 3, "ok": 3, "exact": 3}]


def test_two_replicas_share_one_directory(tmp_path):
    d = str(tmp_path / "store")
    a_done, b_done = str(tmp_path / "a.done"), str(tmp_path / "b.done")
    # Both replicas serve prompt 1 (the same blocks, written concurrently); each also has its own
    # prompt, which the other reads once both have finished writing.
    a = _start({"dir": d, "write": [[1, 0, 5], [2, 0, 4]], "done": a_done, "wait_for": [b_done],
                "read": [[3, 4], [1, 5]]})
    rb = run({"dir": d, "write": [[1, 0, 5], [3, 0, 4]], "done": b_done, "wait_for": [a_done],
              "read": [[2, 4], [1, 5]]})
    ra = _result(a)
    assert ra["pid"] != rb["pid"]
    assert ra["written"] == [5, 4] and rb["written"] == [5, 4]
    assert ra["read"] == [{"exists": 4, "ok": 4, "exact": 4}, {"exists": 5, "ok": 5, "exact": 5}]
    assert rb["read"] == [{"exists": 4, "ok": 4, "exact": 4}, {"exists": 5, "ok": 5, "exact": 5}]
