"""Fixtures: the agent as a real separate process on loopback (UCX over TCP, UCX_MODULES=^ib)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

from tests.agent.tenants import NS, PAGE, SECRETS, host, keys_file

os.environ.setdefault("UCX_MODULES", "^ib")
SECRET = b"test-secret-0123456789abcdef"


def nixl_available() -> bool:
    """Whether NIXL is installed (without loading it into the test process)."""
    import importlib.util

    return importlib.util.find_spec("nixl") is not None


needs_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL (pip install nixl) not installed")


class AgentProc:
    def __init__(self, tmp: Path, args: list[str], port: int = 0):
        self.tmp = tmp
        self.args = args
        self.port = port
        self.proc: subprocess.Popen | None = None
        self.log = tmp / f"agent-{time.monotonic_ns()}.log"

    def start(self, timeout: float = 30.0) -> "AgentProc":
        ready = self.tmp / f"ready-{time.monotonic_ns()}"
        env = dict(os.environ, SGLANG_OFFLOAD_SECRET=SECRET.decode(), UCX_MODULES="^ib",
                   PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "offload.cli", "agent", "--listen", f"127.0.0.1:{self.port}",
               "--ready-file", str(ready), *self.args]
        self._logf = open(self.log, "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._logf, stderr=subprocess.STDOUT)
        end = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited {self.proc.returncode}: {self.log.read_text()}")
            if time.monotonic() > end:
                raise RuntimeError(f"agent not ready in {timeout}s: {self.log.read_text()}")
            time.sleep(0.02)
        self.port = int(ready.read_text())
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._logf.close()


@pytest.fixture
def agent_factory(tmp_path: Path) -> Iterator[Callable[..., AgentProc]]:
    started: list[AgentProc] = []

    def make(*args: str, port: int = 0) -> AgentProc:
        a = AgentProc(tmp_path, list(args), port)
        started.append(a)
        return a.start()

    try:
        yield make
    finally:
        for a in started:
            a.stop()


def wait_for(pred: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


@contextmanager
def recording_sends() -> Iterator[list[bytes]]:
    """Every frame this process sends on a protocol channel meanwhile, as the bytes on the wire."""
    from offload.agent.protocol import frames

    sent: list[bytes] = []
    real = frames.send_parts

    def record(sock, parts, *rest):  # type: ignore[no-untyped-def]
        sent.append(b"".join(bytes(p) for p in parts))
        real(sock, parts, *rest)

    frames.send_parts = record
    try:
        yield sent
    finally:
        frames.send_parts = real


@pytest.fixture
def tenants(tmp_path: Path, agent_factory):
    """An agent serving two tenants; the victim's page stored from its registered pool by
    NIXL, its endpoint proven: (agent, victim, pool, its NIXL metadata). The victim still
    reads its page back at teardown."""
    agent = agent_factory("--memory", "--keys-file", str(keys_file(tmp_path, SECRETS)))
    victim = host(agent, "victim")
    pool = np.frombuffer(os.urandom(16 * PAGE), np.uint8).copy()
    victim.register_region(pool)
    k = NS["victim"].key("v0")
    assert victim.put_many([k], [[memoryview(pool[:PAGE])]]) == [True]
    assert victim._conns[0].nixl, "the victim's own endpoint was not proven"
    md = victim.nixl_metadata()
    assert md is not None
    yield agent, victim, pool, md
    # The victim keeps its service throughout.
    out = np.zeros(PAGE, np.uint8)
    assert victim.get_many([k], [[memoryview(out)]]) == [True]
    assert np.array_equal(out, pool[:PAGE])
    victim.close()
