"""Issue 27: the agent's tables that grew outside every quota, against an agent in this process
(`--transport tcp`) over a real `MemoryStore`.

Namespace descriptions reached the store once per connection and namespace, inline in the PUT:
never bounded (one key left 4,000 rows with no block) and a first PUT waited on the store's
description transaction (up to 60 s on the disk store's index). Now they are described in the
background, once per host key, at most `--max-namespaces` per key.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Iterator

import pytest

from offload.agent.client import AgentStore
from offload.agent.limits import AgentLimits
from offload.agent.server import AgentServer
from offload.keys import Namespace
from offload.store.memory.store import MemoryStore
from tests.agent.conftest import SECRET, wait_for

NS = Namespace(model="m", dtype="bf16", layout="page_first", page_size=16)


class SlowRecords(MemoryStore):
    """A store whose namespace records wait for `go` (the disk index's synced transaction)."""

    def __init__(self) -> None:
        super().__init__(64 << 20)
        self.go = threading.Event()

    def register_namespace(self, ns: Namespace) -> None:
        self.go.wait(60)
        super().register_namespace(ns)


@pytest.fixture
def served() -> Iterator[tuple[SlowRecords, AgentServer]]:
    store = SlowRecords()
    srv = AgentServer(store, SECRET, "127.0.0.1", 0, transport="tcp",
                      limits=AgentLimits(max_namespaces=4))
    srv.start()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield store, srv
    store.go.set()
    srv.stop()
    t.join(5)


def client(srv: AgentServer) -> AgentStore:
    return AgentStore(f"127.0.0.1:{srv.port}", SECRET, transport="tcp", timeout_s=3,
                      connections=1, reconnect_s=0.1)


def test_a_first_put_never_waits_on_the_namespace_record(served) -> None:
    store, srv = served
    c = client(srv)
    try:
        c.register_namespace(NS)
        k = NS.key("first")
        assert c.put_many([k], [[b"block"]]) == [True]      # the record still waits for `go`
        buf = bytearray(5)
        assert c.get_many([k], [[buf]]) == [True] and bytes(buf) == b"block"
        store.go.set()
        assert wait_for(lambda: NS.digest() in store.namespaces)
    finally:
        c.close()


def test_namespace_records_are_bounded_per_key_across_connections(served) -> None:
    store, srv = served
    store.go.set()
    for r in range(5):                      # 5 connections, 4 new namespaces each, then gone
        c = client(srv)
        try:
            for i in range(4):
                ns = dataclasses.replace(NS, model=f"junk-{r}-{i}")
                c.register_namespace(ns)
                k = ns.key("x")
                assert c.put_many([k], [[b"x"]]) == [True]
                c.delete_many([k])
        finally:
            c.close()
    wait_for(lambda: srv.counters().get("namespaces_undescribed", 0) >= 16
             or len(store.namespaces) > 4)
    assert len(store.namespaces) <= 4, f"{len(store.namespaces)} namespace records for one key"
    assert srv.counters()["namespaces_undescribed"] >= 16


def test_frames_and_staging_are_bounded_per_key_and_in_all() -> None:
    """One key's connections may not hold more than its share of the agent's memory: a frame
    past it is refused before its body is allocated (that connection closed), and the bytes
    come back once a request is served."""
    store = MemoryStore(64 << 20)
    srv = AgentServer(store, SECRET, "127.0.0.1", 0, transport="tcp",
                      limits=AgentLimits(max_memory_per_key=3 << 20))
    srv.start()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    c = client(srv)
    try:
        c.register_namespace(NS)
        big, small = NS.key("big"), NS.key("small")
        assert c.put_many([big], [[bytes(4 << 20)]]) == [False]      # past 3 MiB: refused
        assert srv.counters()["rejected_memory"] == 1
        assert wait_for(lambda: c.put_many([small], [[b"x"]]) == [True])     # reconnected
        for i in range(4):                                           # 2 MiB each: given back
            assert c.put_many([NS.key(f"s{i}")], [[bytes(2 << 20)]]) == [True]
        assert wait_for(lambda: srv.memory.held() == 0)          # given back after each reply
    finally:
        c.close()
        srv.stop()
        t.join(5)


def test_memory_bound_unit() -> None:
    from offload.agent.budget import Memory

    m = Memory(total=10, per_key=6)
    assert m.take("a", 6) is None and "per-key" in (m.take("a", 1) or "")
    assert m.take("b", 4) is None and "--max-memory " in (m.take("c", 1) or "")
    m.give("a", 6)
    assert m.take("c", 1) is None and m.held() == 5 and m.held("a") == 0
