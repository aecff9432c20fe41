"""A PUT to the agent's disk store is acknowledged once written, and hidden until durable.

The agent runs in this process on loopback (`--transport tcp`: the bytes travel on the
connection) over a real `DiskStore`; its group commit is held back or failed by wrapping the
store's one fdatasync step (`offload.store.disk.slab.coalesce.sync_segments`), the one thing that decides
when a written block becomes durable. Clients are real `AgentStore`s, one per "host".
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from offload.agent.acks import Acks
from offload.agent.client import AgentStore
from offload.agent.limits import AgentLimits
from offload.agent.server import AgentServer
from offload.keys import Namespace
from offload.store.disk.slab import coalesce
from tests.agent.conftest import SECRET, needs_nixl, wait_for
from tests.store.stores import open_store

NS = Namespace(model="m", dtype="bf16", layout="page_first", page_size=16)
BLOCK = 64 << 10


def keys(n: int, tag: str) -> list[bytes]:
    return [NS.key(f"{tag}-{i}") for i in range(n)]


class Commits:
    """The store's fdatasync step, held back while `hold` is set, failed while `fail` is."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.go = threading.Event()
        self.go.set()
        self.fail = False
        real = coalesce.sync_segments

        def sync(slabs: Any, pool: Any, segs: Any) -> dict:
            self.go.wait(60)
            if self.fail:
                return {s: False for s in segs}
            return real(slabs, pool, segs)

        monkeypatch.setattr(coalesce, "sync_segments", sync)

    def hold(self) -> None:
        self.go.clear()

    def release(self) -> None:
        self.go.set()


@pytest.fixture
def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
        ) -> Iterator[tuple[Commits, Callable[[], AgentStore], AgentServer]]:
    commits = Commits(monkeypatch)
    store = open_store(tmp_path / "store", 64 << 20)
    srv = AgentServer(store, SECRET, "127.0.0.1", 0, transport="tcp")
    srv.start()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    clients: list[AgentStore] = []

    def host(timeout_s: float = 10) -> AgentStore:
        c = AgentStore(f"127.0.0.1:{srv.port}", SECRET, transport="tcp", timeout_s=timeout_s,
                       connections=1)
        c.register_namespace(NS)
        clients.append(c)
        return c

    try:
        yield commits, host, srv
    finally:
        commits.release()
        for c in clients:
            c.close()
        srv.stop()
        t.join(5)
        srv.join(5)
        store.close()


def blocks(n: int) -> list[list[bytes]]:
    return [[os.urandom(BLOCK)] for _ in range(n)]


def test_a_put_is_acknowledged_before_its_commit_and_hidden_until_durable(rig) -> None:
    commits, host, _ = rig
    a, b, impatient = host(), host(), host(timeout_s=1)
    ks, data = keys(4, "early"), blocks(4)
    commits.hold()
    assert a.put_many(ks, data) == [True] * 4        # written: acknowledged, commit held back
    assert b.exists_many(ks) == [False] * 4           # another connection sees nothing yet
    out = [[bytearray(BLOCK)] for _ in range(4)]
    assert b.get_many(ks, out) == [False] * 4         # nor reads it (a miss after a short wait)
    assert a.exists_many(ks) == [False] * 4           # not even the host that put it
    assert impatient.durable(ks) == [False] * 4       # not durable within the request's budget
    commits.release()
    assert a.durable(ks) == [True] * 4                # waits for the commit, then says so
    assert b.exists_many(ks) == [True] * 4
    assert b.get_many(ks, out) == [True] * 4
    assert [bytes(o[0]) for o in out] == [d[0] for d in data]
    assert a.flush() is True


def test_durable_waits_for_the_commit_and_answers_per_key(rig) -> None:
    commits, host, srv = rig
    a, b = host(), host(timeout_s=30)
    ks = keys(3, "wait")
    assert a.put_many(ks[:2], blocks(2)) == [True, True]
    commits.hold()
    assert a.put_many(ks[2:], blocks(1)) == [True]
    answer: list[list[bool]] = []
    asking = threading.Thread(target=lambda: answer.append(b.durable(ks + keys(1, "never"))))
    asking.start()
    # The DURABLE is at the agent, waiting for the held-back round (not answered from what is
    # durable now: that would be False for the third key).
    assert wait_for(lambda: srv.access.usage()["requests"] == 1)
    assert asking.is_alive() and not answer
    commits.release()
    asking.join(30)
    assert answer == [[True, True, True, False]]


def test_a_commit_failing_after_the_ack_is_counted_and_never_served(rig) -> None:
    commits, host, srv = rig
    a, b = host(), host()
    ks = keys(3, "lost")
    commits.hold()
    commits.fail = True                               # the round's fdatasync will fail
    assert a.put_many(ks, blocks(3)) == [True] * 3    # acknowledged: written
    commits.release()
    assert a.durable(ks) == [False] * 3
    assert a.flush() is False                         # a block put since the last flush is lost
    out = [[bytearray(BLOCK)] for _ in range(3)]
    assert b.exists_many(ks) == [False] * 3
    assert b.get_many(ks, out) == [False] * 3
    assert srv.counters().get("put_lost") == 3
    assert b.stats().extra["agent_put_lost"] == 3
    commits.fail = False                              # and the next put of them is stored
    assert a.put_many(ks, blocks(3)) == [True] * 3
    assert a.flush() is True and b.exists_many(ks) == [True] * 3


@pytest.mark.slow
@needs_nixl
def test_staging_writes_overlap_the_next_request_and_keep_every_byte(agent_factory, tmp_path
                                                                     ) -> None:
    """Over NIXL into the disk store: each PUT fills one staging half and is acknowledged while
    its write may still run; the next PUT's READ lands in the other half. Every block reads back
    exactly, and `flush()` says all are durable."""
    import numpy as np

    agent = agent_factory("--store", str(tmp_path / "nixl-store"), "--capacity", "64MiB",
                          "--staging", "1MiB")
    s = AgentStore(agent.address, SECRET, timeout_s=10, connections=1)
    n, per = 8, 4                                  # 8 PUTs of 4 blocks: one half (512 KiB) each
    size = 128 << 10
    src = np.frombuffer(os.urandom(n * per * size), np.uint8).copy()
    dst = np.zeros_like(src)
    s.register_region(src)
    s.register_region(dst)
    ks = keys(n * per, "nixl")

    def view(a: np.ndarray, i: int) -> list[memoryview]:
        return [memoryview(a[i * size:(i + 1) * size])]

    try:
        for r in range(n):
            idx = range(r * per, (r + 1) * per)
            assert s.put_many([ks[i] for i in idx], [view(src, i) for i in idx]) == [True] * per
        assert s.flush() is True
        assert s.get_many(ks, [view(dst, i) for i in range(n * per)]) == [True] * (n * per)
        assert np.array_equal(src, dst)
        extra = s.stats().extra
        assert extra["agent_blocks_staged_in"] == n * per and "agent_put_lost" not in extra
    finally:
        s.close()


class HeldWrites:
    """The agent's disk store with its `put_many` held back (`go`) or failing (`fail`)."""

    def __init__(self, store: Any):
        self.store, self.go, self.fail, self.calls = store, threading.Event(), False, 0
        self.real = store.put_many
        store.put_many = self.put_many

    def put_many(self, keys: list[bytes], blocks: list) -> list[bool]:
        self.calls += 1
        self.go.wait(60)
        return [False] * len(keys) if self.fail else self.real(keys, blocks)


@needs_nixl
def test_a_staged_put_is_acknowledged_while_its_write_runs_and_the_host_may_reuse_its_pages(
        tmp_path: Path) -> None:
    """NIXL over UCX in this process: the agent acknowledges a PUT once NIXL read its blocks into
    staging; the store write goes on (held back here) while the next PUT fills the other half,
    a third waits for the first half to be written. The host overwrites its pages right after
    each acknowledgement; the agent stores what it read. A write failing after its
    acknowledgement is counted lost, never served."""
    import numpy as np

    store = open_store(tmp_path / "store", 64 << 20)
    held = HeldWrites(store)
    srv = AgentServer(store, SECRET, "127.0.0.1", 0, transport="ucx",
                      limits=AgentLimits(staging_size=1 << 20))
    srv.start()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    a = AgentStore(f"127.0.0.1:{srv.port}", SECRET, timeout_s=30, connections=1)
    b = AgentStore(f"127.0.0.1:{srv.port}", SECRET, transport="tcp", timeout_s=30)
    per, size = 4, 128 << 10                         # one PUT: 4 blocks = one staging half
    pool = np.zeros(per * size, np.uint8)
    a.register_region(pool)
    want = [os.urandom(per * size) for _ in range(4)]
    ks = [keys(per, f"held{r}") for r in range(4)]

    def put(r: int) -> list[bool]:
        pool[:] = np.frombuffer(want[r], np.uint8)
        got = a.put_many(ks[r], [[memoryview(pool[i * size:(i + 1) * size])] for i in range(per)])
        pool[:] = 0xEE                               # the host reuses its pages at once
        return got

    try:
        assert put(0) == [True] * per and put(1) == [True] * per    # both writes held back
        assert wait_for(lambda: held.calls == 2)      # one write per half, both running
        assert b.exists_many(ks[0] + ks[1]) == [False] * (2 * per)
        third: list[list[bool]] = []
        t = threading.Thread(target=lambda: third.append(put(2)))
        t.start()                                     # its half is the first one's: it waits
        assert wait_for(lambda: srv.access.usage()["requests"] == 1) and not third
        held.go.set()       # (had it not waited, put 0's bytes would be put 2's: checked below)
        t.join(30)
        assert third == [[True] * per]
        assert a.flush() is True
        for r in range(3):
            out = [[bytearray(size)] for _ in range(per)]
            assert b.get_many(ks[r], out) == [True] * per
            assert b"".join(bytes(o[0]) for o in out) == want[r]
        held.go.clear()
        held.fail = True
        assert put(3) == [True] * per                 # acknowledged; its write will fail
        held.go.set()
        assert a.durable(ks[3]) == [False] * per and a.flush() is False
        assert b.exists_many(ks[3]) == [False] * per
        assert srv.counters().get("put_lost") == per
    finally:
        held.go.set()
        a.close()
        b.close()
        srv.stop()
        srv.join(5)
        store.close()


def test_flush_remembers_a_loss_past_the_keys_it_keeps(rig, monkeypatch) -> None:
    """The client remembers `FLUSH_KEYS` keys for `flush`; past that it asks about the oldest
    at once, and a loss found then still fails the next flush."""
    from offload.agent import client

    commits, host, _ = rig
    monkeypatch.setattr(client, "FLUSH_KEYS", 2)
    a = host()
    ks = keys(4, "bound")
    commits.hold()
    commits.fail = True
    assert a.put_many(ks[:1], blocks(1)) == [True]   # acknowledged, then lost
    commits.release()
    assert a.durable(ks[:1]) == [False]
    commits.fail = False
    for k in ks[1:]:                                  # the third of these asks about the first
        assert a.put_many([k], blocks(1)) == [True]
    assert len(a._unflushed) <= 2
    assert a.flush() is False
    assert a.flush() is True                          # nothing put since


class FakeStore:
    """A store that commits in the background: `durable` answers from `stored`."""

    def __init__(self) -> None:
        self.stored: set[bytes] = set()

    def durable(self, keys: list[bytes]) -> list[bool]:
        return [k in self.stored for k in keys]

    def exists_many(self, keys: list[bytes]) -> list[bool]:
        return [k in self.stored for k in keys]


def test_a_write_failing_after_the_ack_is_counted_lost_and_released() -> None:
    """The staging path acknowledges a block whose store write is still running (None from the
    put's writes); that write failing later is a loss, and the key is released (absent)."""
    counted: dict[str, int] = {}
    acks = Acks(FakeStore(), lambda name, n: counted.__setitem__(name, counted.get(name, 0) + n))
    ks = keys(2, "late")
    later: list[Callable[[], None]] = []

    def write(settle: Any) -> list[bool | None]:
        later.append(lambda: settle(ks, [False, False]))
        return [None, None]

    assert acks.put(ks, write) == [True, True]
    assert acks.hidden(ks) == [True, True]
    later[0]()
    assert acks.hidden(ks) == [False, False]
    assert counted == {"put_lost": 2}
    acks.close()


def test_past_its_bound_a_put_is_acknowledged_only_once_durable() -> None:
    """With `max_hidden` keys hidden, the next put may not leave writes running (`settle` None)
    and is acknowledged with the store's `durable` answer, then released."""
    store = FakeStore()
    acks = Acks(store, lambda name, n: None, max_hidden=1)
    first, second = keys(1, "first"), keys(2, "second")
    assert acks.put(first, lambda settle: [None]) == [True]     # hidden: the table is full
    given: list[Any] = []

    def write(settle: Any) -> list[bool | None]:
        given.append(settle)
        store.stored.add(second[0])                 # one written and durable, one failed
        return [True, False]

    assert acks.put(second, write) == [True, False]
    assert given == [None] and acks.hidden(second) == [False, False]
    assert acks.hidden(first) == [True]
    acks.close()


def test_acknowledged_puts_leave_the_store_rounds_grouped_until_a_reader_waits(rig) -> None:
    """The agent's confirmer waits for the store's commits without hurrying them (one round for
    many PUTs); a GET of a block still hidden starts the round at once."""
    _, host, srv = rig
    store = srv.store
    commits = store._commits
    commits._group_s, commits._group_bytes = 3600.0, 1 << 40   # no round starts on its own
    syncs: list[object] = []
    real_sync = commits._sync
    commits._sync = lambda segs: (syncs.append(segs), real_sync(segs))[1]
    confirming = threading.Event()
    real_wait = commits.wait_for

    def wait_for(ks: Any, timeout: float, hurry: bool = True) -> bool:
        if not hurry:
            confirming.set()
        return real_wait(ks, timeout, hurry)

    commits.wait_for = wait_for
    a, b = host(), host(timeout_s=30)
    ks = keys(6, "grouped")
    for i in range(0, 6, 2):
        assert a.put_many(ks[i:i + 2], blocks(2)) == [True, True]
    assert confirming.wait(30)                        # the confirmer waits for them...
    assert commits._waiting == 0 and syncs == []      # ...without starting a round
    out = [[bytearray(BLOCK)] for _ in range(6)]
    assert b.get_many(ks, out) == [True] * 6          # a reader kicks it: one round for all
    assert len(syncs) == 1 and a.flush() is True


def test_one_tenants_backlog_makes_only_its_own_puts_wait() -> None:
    """Issue 27: the hidden-until-durable table was bounded only in all, so one tenant whose
    puts were not yet durable made every tenant's puts wait for their own commits. Now past its
    own bound only that tenant's puts wait; another's are acknowledged at once."""
    store = FakeStore()
    acks = Acks(store, lambda name, n: None, max_hidden=100, max_hidden_per_key=2)
    given: list[Any] = []

    def write(settle: Any) -> list[bool | None]:
        given.append(settle)
        return [None] * 2 if settle is not None else [False] * 2

    assert acks.put(keys(2, "a1"), write, "a") == [True, True]          # hidden: a's 2
    assert acks.put(keys(2, "b1"), write, "b") == [True, True]          # b not affected
    assert given[0] is not None and given[1] is not None
    acks.put(keys(2, "a2"), write, "a")                                 # a waits for its own
    assert given[2] is None
    acks.close()
