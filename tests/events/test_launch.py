"""`launch` with SGLang's `kv-events-config`: the backend is told each page's parent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch.helpers import dry_run, write

BASE = "sglang:\n  model-path: meta-llama/Llama-3.1-70B-Instruct\n  tp-size: 8\n  page-size: 64\n"
EVENTS = "  kv-events-config: '{\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}'\n"


def extra_of(capsys: pytest.CaptureFixture[str], cfg: Path) -> dict:
    argv = dry_run(capsys, cfg)["argv"]
    return json.loads(argv[argv.index("--hicache-storage-backend-extra-config") + 1])


def test_kv_events_turn_on_prefix_keys(capsys, tmp_path: Path) -> None:
    assert extra_of(capsys, write(tmp_path, BASE + EVENTS))["hicache_storage_pass_prefix_keys"]
    assert "hicache_storage_pass_prefix_keys" not in extra_of(capsys, write(tmp_path, BASE))
