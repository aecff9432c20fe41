"""Path routing: an explicit config wins, `auto` follows detection; each path opens lazily."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest

from offload.config import load_offload
from offload.errors import PathUnavailableError
from offload.store.memory.store import MemoryStore
from offload.transfer.base import choose_path, open_path


@dataclass
class FakeDecision:
    path: str
    role: str = "host"
    numa_node: int | None = None


def cfg(**transfer):
    tree = {"transfer": transfer}
    if transfer.get("path") == "dpu":
        tree["agent"] = {"address": "127.0.0.1:9", "transport": "tcp", "timeout_s": 0.5}
    return load_offload(tree)


def test_explicit_path_wins_over_detection() -> None:
    assert choose_path(cfg(path="cpu"), FakeDecision("dpu")) == "cpu"
    assert choose_path(cfg(path="dpu"), FakeDecision("cpu")) == "dpu"


@pytest.mark.parametrize("decided", ["cpu", "gds", "dpu"])
def test_auto_follows_the_decision(decided: str) -> None:
    assert choose_path(cfg(path="auto"), FakeDecision(decided)) == decided


def test_auto_on_the_dpu_arm_has_no_host_path() -> None:
    with pytest.raises(PathUnavailableError, match="sglang-offload agent"):
        choose_path(cfg(), FakeDecision("cpu", role="agent"))


def test_auto_runs_detection_when_no_decision_is_given(tmp_path) -> None:
    c = load_offload({"store": {"path": str(tmp_path)}})
    assert choose_path(c) in ("cpu", "gds", "dpu")      # this CPU-only machine: cpu
    assert choose_path(c) == "cpu"


def test_cpu_path_opens_with_the_decided_numa_node() -> None:
    p = open_path(cfg(path="auto"), FakeDecision("cpu", numa_node=0), store=MemoryStore())
    try:
        assert p.name == "cpu" and p.numa_node == 0
        assert p.put_many([b"k" * 32], [[b"abc"]]) == [True]
    finally:
        p.close()


def test_dpu_path_opens_an_agent_client(monkeypatch) -> None:
    monkeypatch.setenv("SGLANG_OFFLOAD_SECRET", "0123456789abcdef0123")
    p = open_path(cfg(path="dpu"))
    try:
        assert p.name == "dpu"
        assert p.exists_many([b"k" * 32]) == [False]     # nobody listens there: a miss
    finally:
        p.close()


def test_importing_the_router_loads_no_heavy_library() -> None:
    import subprocess

    code = ("import sys, offload.transfer.base, offload.agent.client, offload.transfer.cpu_staging;"
            "bad = [m for m in ('nixl', 'kvikio', 'torch') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
