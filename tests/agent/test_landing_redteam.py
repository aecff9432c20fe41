"""Red-team of issue 36's change (the landing area, one deadline per call): holes proven against a
real agent process on loopback (NIXL over UCX, UCX_MODULES=^ib), each marked xfail(strict) until
fixed, so the suite stays green and a fix turns it into a failure to un-mark.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from offload.agent.client import AgentStore
from offload.keys import Namespace
from tests.agent.conftest import SECRET, needs_nixl, wait_for

NS = Namespace(model="m", dtype="bf16", layout="page_first", page_size=64)


@needs_nixl
@pytest.mark.xfail(strict=True, reason=(
    "5dcca80: `AgentConn._prove` raises Down whenever the call's deadline passes without a proof "
    "notification, and `proof_nonces` returns [] only then, so the inline fallback below it is "
    "dead: a host the agent's NIXL notifications cannot reach misses every call after waiting "
    "its whole timeout_s (no mark_down, no back-off), where 91598c4 moved the bytes inline"))
def test_a_proof_notification_that_never_arrives_falls_back_to_the_control_connection(
        agent_factory) -> None:
    """The agent cannot reach this host's NIXL endpoint (a route or firewall between the DPU and
    the host's UCX address): its proof notifications never arrive. The connection must still
    serve the cache, its bytes on the control connection (what conn.py logs it does). The
    unreachable path cannot be built on a shared loopback machine without a firewall rule, so
    the host's NIXL agent here drops the notifications it receives (the one thing injected)."""
    agent = agent_factory("--memory")
    size, n = 64 << 10, 4
    keys = [NS.key(f"noproof-{i}") for i in range(n)]
    src = np.frombuffer(os.urandom(n * size), np.uint8).copy()
    dst = np.zeros(n * size, np.uint8)
    s = AgentStore(agent.address, SECRET, timeout_s=1.0, reconnect_s=0.2, connections=1)
    s.register_region(src)
    s.register_region(dst)
    assert s._nixl is not None
    s._nixl.get_new_notifs = lambda: {}          # the agent's notifications never arrive

    def views(a: np.ndarray) -> list[list[memoryview]]:
        return [[memoryview(a[i * size:(i + 1) * size])] for i in range(n)]

    try:
        # Measured: 8 of 8 rounds missed both calls, each after its whole 1.0 s (91598c4: the
        # first put missed, every later call was True on the control connection).
        stored = False
        for _ in range(4):
            if s.put_many(keys, views(src)) == [True] * n:
                stored = True
                break
        assert stored, "every put missed: no connection ever falls back to inline bytes"
        assert s.get_many(keys, views(dst)) == [True] * n
        assert np.array_equal(src, dst)
    finally:
        s.close()


@needs_nixl
@pytest.mark.xfail(strict=True, reason=(
    "put_many is two calls, each with its own timeout_s: `_blocks` (PUT) then `durable(old)` "
    "(DURABLE) once more than FLUSH_KEYS keys are unflushed; measured: 1.70 s with timeout_s "
    "1.0, the agent stopped 0.7 s during the PUT and again as the DURABLE went out"))
def test_put_many_shares_one_deadline_with_the_durable_it_sends(agent_factory, monkeypatch
                                                                ) -> None:
    """Every request of one call carries the call's one deadline (docs/security/agent.md): the
    DURABLE that put_many sends for its oldest unflushed keys too. The deadlines each request was
    given are recorded (the requests themselves run for real); no clock is read."""
    from offload.agent import client
    from offload.agent.conn import AgentConn

    agent = agent_factory("--memory")
    s = AgentStore(agent.address, SECRET, timeout_s=5.0, reconnect_s=0.2, connections=1)
    monkeypatch.setattr(client, "FLUSH_KEYS", 1)      # the setting (65,536), lowered
    seen: list[tuple[int, float | None]] = []
    real = AgentConn.request

    def request(self, op, msg, payload=None, deadline=None):  # type: ignore[no-untyped-def]
        seen.append((op, deadline))
        return real(self, op, msg, payload, deadline)

    try:
        blk = os.urandom(4096)
        for _ in range(20):        # the first call may spend its deadline connecting
            s._unflushed.clear()
            seen.clear()
            monkeypatch.setattr(AgentConn, "request", request)
            ok = s.put_many([NS.key("d-a"), NS.key("d-b")], [[blk], [blk]])
            monkeypatch.setattr(AgentConn, "request", real)
            if ok == [True, True]:
                break
        assert ok == [True, True]
        from offload.agent import protocol

        ops = [op for op, _ in seen]
        assert protocol.PUT in ops and protocol.DURABLE in ops, ops
        assert len({d for _, d in seen}) == 1, f"{len({d for _, d in seen})} deadlines in one call"
    finally:
        s.close()


@needs_nixl
@pytest.mark.xfail(strict=True, reason=(
    "`AgentStore._use` with every connection busy waits for the next one in turn only, until the "
    "call's deadline: a connection freed meanwhile is not taken, so the call misses while one is "
    "idle (a GET stuck on one connection makes the next call behind it miss)"))
def test_a_call_takes_the_first_connection_freed_before_its_deadline(agent_factory) -> None:
    """Both connections busy; the second is freed soon after a call starts waiting, the first
    stays held past the call's deadline. The call should run on the freed one."""
    import threading

    agent = agent_factory("--memory")
    s = AgentStore(agent.address, SECRET, timeout_s=2.0, reconnect_s=0.2, connections=2)
    key = NS.key("first-free")
    try:
        blk = b"y" * 4096
        assert wait_for(lambda: s.put_many([key], [[blk]]) == [True], 120)
        c0, c1 = s._conns
        s._next = 0                                  # the next in turn is the first
        out: list[list[bool]] = []
        with c0.lock:
            c1.lock.acquire()
            t = threading.Thread(target=lambda: out.append(s.exists_many([key])))
            t.start()
            waiting = threading.Event()
            # The call is past its non-blocking tries once it bumped `_next`.
            for _ in range(1000):
                if s._next == 1:
                    waiting.set()
                    break
                threading.Event().wait(0.01)
            c1.lock.release()                        # a connection is free long before the deadline
            t.join(120)
        assert waiting.is_set()
        assert out == [[True]], "the call missed while a connection was free"
    finally:
        s.close()
