"""Issue 36: a page `get_many` reported as a miss is never written afterwards by the agent.

The agent is a real process on loopback (NIXL over UCX, UCX_MODULES=^ib). It is SIGSTOPped
around a GET so that the host gives up on it (its `timeout_s`), then resumed: before the fix, the
resumed agent read the GET's frame (a closed or reset connection does not withdraw frames already
in the agent's socket) and WROTE the block into the host pages named in it, long after they had
been reported as misses and handed back to SGLang (1,044,473 of 1,048,576 bytes overwritten,
`/tmp/c/late/late_write.py`). Now a GET names only the store's own landing area; the host copies
into the caller's pages after a good reply. No wall-clock assertion: each wait is a generous
bound on the test, polled.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from offload.agent.client import AgentStore
from offload.keys import Namespace
from tests.agent.conftest import SECRET, needs_nixl, wait_for

pytestmark = pytest.mark.slow

NS = Namespace(model="m", dtype="bf16", layout="page_first", page_size=64)
REUSED = 0xAB          # what SGLang writes into pages handed back to it


def _stop(pid: int) -> None:
    """SIGSTOP `pid` and wait until it is stopped (the signal is asynchronous)."""
    os.kill(pid, signal.SIGSTOP)
    assert wait_for(lambda: _state(pid) == "T", 30), "the agent did not stop"


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _store(agent, **kw) -> AgentStore:
    return AgentStore(agent.address, SECRET, timeout_s=2.0, reconnect_s=0.2, **kw)


def _views(a: np.ndarray, n: int, size: int) -> list[list[memoryview]]:
    return [[memoryview(a[i * size:(i + 1) * size])] for i in range(n)]


def _put(s: AgentStore, keys: list[bytes], src: np.ndarray, size: int) -> None:
    """Put until stored: the first call may spend its whole deadline connecting (NIXL metadata
    checked in a child process on a loaded machine); the next finds it checked."""
    assert wait_for(lambda: s.put_many(keys, _views(src, len(keys), size)) == [True] * len(keys),
                    120), "the blocks were never stored"


def _gets(s: AgentStore) -> int:
    return int(s.stats().extra.get("agent_get", 0))


@needs_nixl
def test_a_get_read_late_by_a_stopped_agent_never_writes_the_given_up_pages(agent_factory) -> None:
    """The colleague's repro: the agent stopped before it reads the GET (it reads it late, after
    SIGCONT, as an overloaded agent would); the pages stay SGLang's, also once the agent has
    served the late GET and every transfer of it is final."""
    agent = agent_factory("--memory")
    size, n = 256 << 10, 4
    keys = [NS.key(f"late-{i}") for i in range(n)]
    src = np.frombuffer(os.urandom(n * size), np.uint8).copy()
    dst = np.zeros(n * size, np.uint8)
    s = _store(agent, connections=1)
    s.register_region(src)
    s.register_region(dst)
    try:
        _put(s, keys, src, size)
        assert s.get_many(keys, _views(dst, n, size)) == [True] * n and np.array_equal(src, dst)
        before = _gets(s)
        dst[:] = 0
        _stop(agent.proc.pid)
        try:
            assert s.get_many(keys, _views(dst, n, size)) == [False] * n
            assert not dst.any(), "a page reported as a miss was written before the call returned"
            dst[:] = REUSED
            assert s._landing is not None and s._landing.held() >= n * size   # not reused
        finally:
            os.kill(agent.proc.pid, signal.SIGCONT)
        # The agent serves the late GET, then the host's next calls (it reconnects).
        assert wait_for(lambda: _gets(s) > before, 120), "the agent never served the late GET"
        assert wait_for(lambda: s.stats().extra.get("agent_quarantined_now", 1) == 0, 60)
        other = np.zeros(n * size, np.uint8)
        s.register_region(other)
        assert wait_for(lambda: s.get_many(keys, _views(other, n, size)) == [True] * n, 60)
        assert np.array_equal(other, src)
        changed = int(np.count_nonzero(dst != REUSED))
        assert changed == 0, f"{changed} bytes of pages reported as misses were overwritten"
    finally:
        try:
            os.kill(agent.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        s.close()


@needs_nixl
def test_an_agent_stopped_mid_transfer_never_writes_the_given_up_pages(agent_factory) -> None:
    """The agent is stopped at several points of a large GET (before it reads it, while it posts
    or finishes its WRITEs, after): whatever each call returned, once it returned nothing writes
    its pages again; a page reported loaded holds its block."""
    agent = agent_factory("--memory")
    size, n = 1 << 20, 16
    keys = [NS.key(f"mid-{i}") for i in range(n)]
    src = np.frombuffer(os.urandom(n * size), np.uint8).copy()
    dst = np.zeros(n * size, np.uint8)
    s = _store(agent, connections=1)
    s.register_region(src)
    s.register_region(dst)
    pid = agent.proc.pid
    try:
        _put(s, keys, src, size)
        missed = 0
        for delay in (0.0, 0.002, 0.01, 0.03, 0.1):
            dst[:] = 0
            stopper = threading.Timer(delay, _stop, (pid,))
            stopper.start()
            got = s.get_many(keys, _views(dst, n, size))
            stopper.join()
            for i, f in enumerate(got):
                page = dst[i * size:(i + 1) * size]
                if f:
                    assert np.array_equal(page, src[i * size:(i + 1) * size])
                else:
                    missed += 1
                    assert not page.any(), f"block {i}: a page reported as a miss was written"
            dst[:] = REUSED
            if _state(pid) != "T":
                _stop(pid)
            time.sleep(2.5)          # past the host's deadline while the agent is stopped
            os.kill(pid, signal.SIGCONT)
            assert wait_for(lambda: s.exists_many(keys) == [True] * n, 120)
            assert wait_for(lambda: s.stats().extra.get("agent_quarantined_now", 1) == 0, 60)
            changed = int(np.count_nonzero(dst != REUSED))
            assert changed == 0, f"delay {delay}: {changed} bytes written after the call returned"
        assert missed, "no GET was given up on: the scenario did not happen"
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        s.close()


@needs_nixl
def test_a_call_waiting_for_a_busy_connection_is_bounded_by_its_own_deadline(agent_factory
                                                                            ) -> None:
    """With its only connection held (another call stuck on it), a call is a miss by its own
    deadline, not after the other call lets go (before: `_use` waited without a timeout)."""
    agent = agent_factory("--memory")
    s = AgentStore(agent.address, SECRET, timeout_s=1.0, reconnect_s=0.2, connections=1)
    key = NS.key("busy")
    try:
        assert wait_for(lambda: s.put_many([key], [[b"x" * 4096]]) == [True], 120)
        out: list[list[bool]] = []
        release = threading.Event()
        with s._use() as (c, _):
            assert c is not None
            t = threading.Thread(target=lambda: out.append(s.exists_many([key])))
            t.start()
            t.join(120)                 # generous: the call's own deadline is 1 s
            finished = not t.is_alive()
            release.set()
        t.join(120)
        assert finished, "the call waited for the busy connection past its deadline"
        assert out == [[False]]
        assert s.exists_many([key]) == [True]          # the connection is usable after
    finally:
        s.close()
