"""Red-team of issue 36's change (the landing area, one deadline per call): holes proven against a
real agent process on loopback (NIXL over UCX, UCX_MODULES=^ib), each failing before its fix: a
proof notification that never arrives (every call missed its whole timeout_s), put_many's DURABLE
with a deadline of its own, a call waiting for one busy connection while another was freed.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from offload.agent.client import AgentStore
from offload.keys import Namespace
from tests.agent.conftest import SECRET, needs_nixl, wait_for

pytestmark = pytest.mark.slow

NS = Namespace(model="m", dtype="bf16", layout="page_first", page_size=64)


@needs_nixl
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
    s = AgentStore(agent.address, SECRET, timeout_s=3.0, reconnect_s=0.2, connections=1)
    s.register_region(src)
    s.register_region(dst)
    assert s._nixl is not None
    real_notifs = s._nixl.get_new_notifs
    s._nixl.get_new_notifs = lambda: {}          # the agent's notifications never arrive

    def views(a: np.ndarray) -> list[list[memoryview]]:
        return [[memoryview(a[i * size:(i + 1) * size])] for i in range(n)]

    try:
        # Measured: 8 of 8 rounds missed both calls, each after its whole 1.0 s (91598c4: the
        # first put missed, every later call was True on the control connection).
        stored = False
        for _ in range(6):                       # a loaded box may miss the first few
            if s.put_many(keys, views(src)) == [True] * n:
                stored = True
                break
        assert stored, "every put missed: no connection ever falls back to inline bytes"
        assert s.get_many(keys, views(dst)) == [True] * n
        assert np.array_equal(src, dst)
        assert not s._conns[0].nixl
        # The notifications reach the host again: a later call proves again and moves by NIXL.
        s._nixl.get_new_notifs = real_notifs
        assert wait_for(lambda: s.exists_many(keys) == [True] * n and s._conns[0].nixl, 60)
    finally:
        s.close()


@needs_nixl
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
def test_a_call_takes_the_first_connection_freed_before_its_deadline(agent_factory) -> None:
    """Both connections busy; the second is freed soon after a call starts waiting, the first
    stays held past the call's deadline. The call should run on the freed one."""
    import threading

    agent = agent_factory("--memory")
    s = AgentStore(agent.address, SECRET, timeout_s=10.0, reconnect_s=0.2, connections=2)
    key = NS.key("first-free")
    try:
        blk = b"y" * 4096
        assert wait_for(lambda: s.put_many([key], [[blk]]) == [True], 120)
        c0, c1 = s._conns
        out: list[list[bool]] = []
        with c0.lock:
            c1.lock.acquire()
            t = threading.Thread(target=lambda: out.append(s.exists_many([key])))
            t.start()
            threading.Event().wait(0.3)              # the call is waiting for a connection
            with s._released:                        # released as a call's end releases it
                c1.lock.release()
                s._released.notify()
            t.join(120)
        assert out == [[True]], "the call missed while a connection was free"
    finally:
        s.close()
