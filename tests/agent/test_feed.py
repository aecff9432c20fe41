"""The agent's announcement feed (ANNOUNCE / FEED): two hosts on one real agent process name each
other's pages in their KV events, and hostile requests are bounded, scoped and refused.

Before the feed, a host sharing the agent announced only its own pages as `EXTERNAL`; the test of
two replicas fails on that code (the second host's source saw nothing).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from offload.agent import protocol
from offload.agent.client import AgentStore
from offload.agent.feed import Feeds, Page
from offload.events import sources_for
from offload.events.chain import REMOVED, STORED, Row, page_rows
from offload.events.feeds import AgentFeed
from offload.events.sources import SharedSource
from offload.keys import Namespace
from tests.agent.conftest import SECRET, wait_for
from tests.agent.tenants import NS as TENANT_NS
from tests.agent.tenants import SECRETS, Raw, closed_by_peer, host, keys_file

pytestmark = pytest.mark.slow

NS = Namespace(model="m", dtype="bf16", layout="page_first", page_size=16)


def rows_for(n: int, seed: str, ns: Namespace = NS) -> list[Row]:
    keys = [hashlib.sha256(f"{seed}{i}".encode()).hexdigest() for i in range(n)]
    return page_rows(keys, [ns.key(k) for k in keys], [True] * n, None)


def replica(agent, name: str) -> AgentStore:
    s = AgentStore(agent.address, SECRET, transport="tcp", timeout_s=5, reconnect_s=0.1, name=name)
    s.register_namespace(NS)
    return s


def source(store: AgentStore) -> SharedSource:
    return SharedSource(store, AgentFeed(store, NS.digest()))


def _poll_until(src: SharedSource, want: int) -> list[tuple[str, Row]]:
    """Poll until `want` changes came (a disk store's commit makes a page durable a bit later)."""
    got: list[tuple[str, Row]] = []

    def more() -> bool:
        got.extend(src.poll())
        return len(got) >= want
    wait_for(more, 30)
    return got


@pytest.mark.parametrize("store", ["--memory", "disk"])
def test_two_hosts_on_one_agent_see_each_others_pages_and_removals(agent_factory, tmp_path: Path,
                                                                    store: str) -> None:
    args = ["--memory"] if store == "--memory" else ["--store", str(tmp_path / "agent-cache")]
    agent = agent_factory(*args, "--transport", "tcp")
    a, b = replica(agent, "replica-a"), replica(agent, "replica-b")
    try:
        sa, sb = source(a), source(b)
        assert sources_for(a, NS.digest())[0].feed.store is a      # what a backend builds
        rows = rows_for(3, "a")
        assert a.put_many([r.key for r in rows], [[b"y" * 1024] for _ in rows]) == [True] * 3
        sa.wrote(rows)
        assert sorted(_poll_until(sa, 3)) == sorted((STORED, r) for r in rows)  # its own, read back
        assert sorted(_poll_until(sb, 3)) == sorted((STORED, r) for r in rows)  # the other host's
        mine = rows_for(2, "b")
        assert b.put_many([r.key for r in mine], [[b"z" * 512] for _ in mine]) == [True] * 2
        sb.wrote(mine)
        assert sorted(_poll_until(sb, 2)) == sorted((STORED, r) for r in mine)
        assert sorted(_poll_until(sa, 2)) == sorted((STORED, r) for r in mine)
        late = source(replica(agent, "replica-late"))
        assert sorted(late.poll()) == sorted((STORED, r) for r in rows + mine)   # a new host
        assert b.delete_many([rows[0].key]) == 1
        assert sa.poll() == [(REMOVED, rows[0])] and sb.poll() == [(REMOVED, rows[0])]
        other = SharedSource(a, AgentFeed(a, Namespace(**{**NS.__dict__, "model": "o"}).digest()))
        assert other.poll() == []                                    # another namespace's feed
        assert a.stats().extra["agent_feed_pages"] == 4              # the deleted one forgotten
        late.store.close()
    finally:
        a.close()
        b.close()


def test_a_page_not_durable_on_the_agent_is_not_recorded(agent_factory) -> None:
    agent = agent_factory("--memory", "--transport", "tcp")
    a = replica(agent, "replica-a")
    try:
        rows = rows_for(2, "absent")
        assert a.announce([(r.key, r.hash, r.parent) for r in rows]) == [False, False]
        page = a.feed(NS.digest(), 0)
        assert page is not None and page.pages == [] and page.first == 0
    finally:
        a.close()


def test_a_restarted_agent_is_read_again_from_its_start(agent_factory) -> None:
    agent = agent_factory("--memory", "--transport", "tcp")
    port = agent.port
    a = replica(agent, "replica-a")
    try:
        src = source(a)
        rows = rows_for(2, "before")
        assert all(a.put_many([r.key for r in rows], [[b"x"] for _ in rows]))
        src.wrote(rows)
        assert len(_poll_until(src, 2)) == 2
        agent.stop()
        again = agent_factory("--memory", "--transport", "tcp", port=port)
        fresh = rows_for(1, "after")
        assert wait_for(lambda: a.put_many([fresh[0].key], [[b"x"]]) == [True], 15)
        src.wrote(fresh)                                # a new epoch, sequence 1 again
        got = _poll_until(src, 3)
        assert (STORED, fresh[0]) in got
        assert sorted(r for op, r in got if op == REMOVED) == sorted(rows)   # memory was lost
        assert again.port == port and a.stats().extra["agent_feed_pages"] == 1
    finally:
        a.close()


def test_feeds_are_bounded_per_host_key_and_read_in_order() -> None:
    f = Feeds(per_tenant=3)
    ns = NS.digest()
    pages = [Page(NS.key(f"p{i}"), i, None) for i in range(5)]
    f.announce("victim", pages[:2])
    f.announce("attacker", pages[2:5])
    got, nxt, first = f.read(ns, 0, 10)
    assert [p.hash for p in got] == [0, 1, 2, 3, 4] and nxt == 5 and first == 1
    flood = [Page(NS.key(f"junk{i}"), 100 + i, None) for i in range(1000)]
    f.announce("attacker", flood)                      # past its cap: only its own oldest go
    got, _, _ = f.read(ns, 0, 10_000)
    assert [p.hash for p in got] == [0, 1, 1097, 1098, 1099] and f.size() == 5
    assert f.read(ns, nxt, 2)[0] == [Page(NS.key("junk997"), 1097, None),
                                     Page(NS.key("junk998"), 1098, None)]   # a cursor, a limit
    f.announce("victim", [pages[0]])                   # announced again: moves to the end
    assert [p.hash for p in f.read(ns, 0, 10)[0]] == [1, 1097, 1098, 1099, 0]
    f.forget([pages[1].key])
    got, _, first = f.read(ns, 0, 10)
    assert [p.hash for p in got] == [1097, 1098, 1099, 0] and first == 1003
    other = Namespace(**{**NS.__dict__, "model": "o"}).digest()
    assert f.read(other, 0, 10) == ([], 0, 0)


@pytest.fixture
def tenants(tmp_path: Path, agent_factory):
    agent = agent_factory("--memory", "--transport", "tcp", "--keys-file",
                          str(keys_file(tmp_path, SECRETS)))
    victim = host(agent, "victim", transport="tcp")
    k = TENANT_NS["victim"].key("v0")
    assert victim.put_many([k], [[b"victim"]]) == [True]
    assert victim.announce([(k, 7, None)]) == [True]
    yield agent, victim, k
    page = victim.feed(TENANT_NS["victim"].digest(), 0)       # the victim's feed is intact
    assert page is not None and page.pages == [(k, 7, None)]
    victim.close()


def test_a_tenant_reads_and_announces_only_its_own_namespaces(tenants) -> None:
    agent, victim, k = tenants
    attacker = Raw(agent, "attacker", None)
    reply = attacker.call(protocol.FEED, protocol.FeedRead(TENANT_NS["victim"].digest()))[0]
    assert isinstance(reply, protocol.ErrorReply) and "not granted" in reply.message
    reply = attacker.call(protocol.ANNOUNCE, protocol.Announce([(k, 666, None)]))[0]
    assert isinstance(reply, protocol.ErrorReply) and "not granted" in reply.message
    own = TENANT_NS["attacker"].key("a0")
    reply = attacker.call(protocol.ANNOUNCE, protocol.Announce([(own, 1, None)]))[0]
    assert reply == protocol.Flags([False])                 # a block it never stored
    assert isinstance(attacker.call(protocol.FEED, protocol.FeedRead(
        TENANT_NS["attacker"].digest()))[0], protocol.FeedPage)


class _Wide(protocol.Msg, frozen=True):
    pages: list[tuple[bytes, int, int | None]]


class _WideRead(protocol.Msg, frozen=True):
    ns: bytes
    after: int = 0
    limit: int = 1


@pytest.mark.parametrize("op,msg,why", [
    (protocol.ANNOUNCE, _Wide([(b"K" * 32, 1, None)] * (protocol.MAX_KEYS + 1)), "bad announce"),
    (protocol.ANNOUNCE, _Wide([(b"K" * 32, 1 << 63, None)]), "bad announce"),
    (protocol.ANNOUNCE, _Wide([(b"short", 1, None)]), "bad announce"),
    (protocol.FEED, _WideRead(b"n" * 16, limit=protocol.MAX_KEYS + 1), "bad feed"),
    (protocol.FEED, _WideRead(b"n" * 16, after=-1), "bad feed"),
    (protocol.FEED, _WideRead(b"n" * 40), "bad feed"),
])
def test_an_over_large_or_malformed_feed_request_closes_only_its_connection(
        tenants, op: int, msg: protocol.Msg, why: str) -> None:
    agent, victim, _k = tenants
    attacker = Raw(agent, "attacker", None)
    attacker.req += 1
    attacker.ch.send(op, attacker.req, msg)
    assert closed_by_peer(attacker.ch.sock)
    assert wait_for(lambda: why in agent.text())
    assert victim.exists_many([TENANT_NS["victim"].key("v0")]) == [True]
