"""Issue 36: every byte the agent holds for a host key is charged to that key before it is
allocated and given back only once it is free (`offload.agent.budget.Memory`): request frames,
their replies (an inline GET's blocks), staging, the feed book.

On 694c69d the replies were not charged: 16 connections each sending one inline GET of 4 x 3.9
MiB of the key's own blocks and never reading the reply grew the agent by ~250 MiB against
`--max-memory 64MiB` / `--max-memory-per-key 32MiB`. The invariant test walks every message type
of the protocol (and ERROR replies) on a real agent process and checks, through the agent's own
accounting, that no reply was larger than its charge and that everything charged came back.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import numpy as np
import pytest

from offload.agent import protocol
from tests.agent.conftest import needs_nixl, wait_for
from tests.agent.tenants import NS, SECRETS, Raw, host, keys_file, rss, stats

pytestmark = pytest.mark.slow

PAGE = 4096
MIB = 1 << 20


def test_unread_inline_replies_are_charged_to_their_key(tmp_path: Path, agent_factory) -> None:
    agent = agent_factory("--memory", "--transport", "tcp", "--max-memory", "64MiB",
                          "--max-memory-per-key", "32MiB", "--memory-reserve", "1MiB",
                          "--keys-file", str(keys_file(tmp_path, SECRETS)))
    size = 3900 * 1024
    attacker = Raw(agent, "attacker", None)
    keys = [NS["attacker"].key(f"big-{i}") for i in range(4)]
    for k in keys:
        reply = attacker.call(protocol.PUT, protocol.Blocks([k], [size]),
                              [memoryview(os.urandom(size))])[0]
        assert reply == protocol.Flags([True])
    counters = stats(attacker)
    done0 = int(counters.get("agent_get", 0)) + int(counters.get("agent_bad_requests", 0))
    before = rss(agent.proc.pid)
    conns = [Raw(agent, "attacker", None) for _ in range(16)]
    for c in conns:                              # a GET whose reply is never read
        c.req += 1
        c.ch.send(protocol.GET, c.req, protocol.Blocks(keys, [size] * 4))

    def served() -> bool:
        f = stats(attacker)
        return int(f.get("agent_get", 0)) + int(f.get("agent_bad_requests", 0)) >= done0 + 16
    assert wait_for(served, 60)
    grown = rss(agent.proc.pid) - before
    assert grown < 96 * MIB, f"the agent grew {grown >> 20} MiB (--max-memory 64MiB)"
    fields = stats(attacker)
    assert int(fields.get("agent_rejected_memory", 0)) >= 14       # 2 replies fit in 32 MiB
    assert int(fields["agent_memory_held"]) <= 64 * MIB
    assert int(fields["agent_memory_held_key"]) <= 32 * MIB
    # Another tenant is served within what is left.
    victim = host(agent, "victim", transport="tcp")
    try:
        k = NS["victim"].key("v")
        assert victim.put_many([k], [[b"v" * PAGE]]) == [True]
        assert victim.exists_many([k]) == [True]
    finally:
        victim.close()
        for c in conns:
            c.ch.sock.close()


def _walk(agent, pool: np.ndarray) -> set[int]:
    """Every request type, served and refused, by a NIXL host and by hand; the ops sent."""
    sent = {protocol.HELLO, protocol.PROVE, protocol.REGISTER_NS, protocol.PUT, protocol.GET}
    victim = host(agent, "victim", connections=1)         # HELLO, PROVE, REGISTER_NS
    try:
        victim.register_region(pool)
        ks = [NS["victim"].key(f"n{i}") for i in range(4)]
        views = [[memoryview(pool[i * PAGE:(i + 1) * PAGE])] for i in range(4)]
        assert victim.put_many(ks, views) == [True] * 4                 # PUT with descriptors
        assert wait_for(lambda: victim.exists_many(ks) == [True] * 4, 30)
        assert victim.get_many(ks, views) == [True] * 4                 # GET with descriptors
        md = victim.nixl_metadata()
        assert md is not None
    finally:
        victim.close()
    raw = Raw(agent, "victim", None)
    mine, theirs = NS["victim"].key("inline"), NS["attacker"].key("x")
    calls: list[tuple[int, protocol.Msg, list[memoryview] | None]] = [
        (protocol.PUT, protocol.Blocks([mine], [PAGE]), [memoryview(b"i" * PAGE)]),
        (protocol.GET, protocol.Blocks([mine], [PAGE]), None),
        (protocol.GET, protocol.Blocks([mine], [protocol.DEFAULT_MAX_BODY]), None),   # refused
        (protocol.EXISTS, protocol.KeyList([mine]), None),
        (protocol.EXISTS, protocol.KeyList([theirs]), None),                         # refused
        (protocol.DURABLE, protocol.Durable([mine]), None),
        (protocol.ANNOUNCE, protocol.Announce([(mine, 1, None)]), None),
        (protocol.FEED, protocol.FeedRead(NS["victim"].digest()), None),
        (protocol.FEED, protocol.FeedRead(NS["attacker"].digest()), None),           # refused
        (protocol.STATS, protocol.Empty(), None),
        (protocol.METADATA, protocol.Metadata(md), None),
        (protocol.PROVE, protocol.Prove([b"n" * protocol.PROOF_NONCE_BYTES], 0), None),  # refused
        (protocol.REGISTER_NS, protocol.RegisterNs(b"d" * 16, "m", "bf16", "page_first", 16),
         None),                                                                       # refused
        (protocol.DELETE, protocol.KeyList([NS["victim"].key("gone")]), None),
        (protocol.DELETE, protocol.KeyList([theirs]), None),                         # refused
    ]
    for op, msg, payload in calls:
        raw.call(op, msg, payload)
        sent.add(op)
    raw.ch.sock.close()
    return sent


@needs_nixl
@pytest.mark.parametrize("store", ["--memory", "disk"])
def test_every_message_type_is_charged_before_and_given_back_after(
        tmp_path: Path, agent_factory, store: str) -> None:
    from offload.agent.feed import PAGE_BYTES

    args = ["--memory"] if store == "--memory" else ["--store", str(tmp_path / "cache")]
    agent = agent_factory(*args, "--keys-file", str(keys_file(tmp_path, SECRETS)))
    pool = np.frombuffer(os.urandom(4 * PAGE), np.uint8).copy()
    sent = _walk(agent, pool)
    assert sent == set(protocol.REQUEST_TYPES), set(protocol.REQUEST_TYPES) - sent
    probe = Raw(agent, "victim", None)
    # What one STATS holds while it is answered: its frame, what it decodes to, its reply's
    # bound.
    meta = len(msgspec.msgpack.encode(protocol.Empty()))
    own = (protocol.META_LEN.size + meta + protocol.MAC_BYTES
           + protocol.decoded_bound(protocol.STATS, meta)
           + protocol.reply_bound(protocol.STATS, protocol.Empty()))

    def settled() -> bool:
        f = stats(probe)
        return int(f["agent_memory_held_key"]) == own + PAGE_BYTES * int(f["agent_feed_pages_key"])
    assert wait_for(settled, 30), stats(probe)
    fields = stats(probe)
    assert int(fields["agent_feed_pages_key"]) == 1            # the one page it announced
    assert "agent_uncharged_bytes" not in fields, fields["agent_uncharged_bytes"]


def test_replies_cut_off_by_their_client_are_given_back(tmp_path: Path, agent_factory) -> None:
    """Connections that close (reset) in the middle of their inline GET replies: every byte
    charged for them comes back, so the key is not locked out by what it abandoned (a charge
    never given back would be a leak; one given back twice a way past the bound)."""
    import socket
    import struct

    agent = agent_factory("--memory", "--transport", "tcp", "--max-memory", "64MiB",
                          "--max-memory-per-key", "32MiB", "--memory-reserve", "1MiB",
                          "--keys-file", str(keys_file(tmp_path, SECRETS)))
    size = 3900 * 1024
    attacker = Raw(agent, "attacker", None)
    keys = [NS["attacker"].key(f"cut-{i}") for i in range(4)]
    for k in keys:
        assert attacker.call(protocol.PUT, protocol.Blocks([k], [size]),
                             [memoryview(os.urandom(size))])[0] == protocol.Flags([True])
    for _ in range(3):                              # rounds: a leak would add up
        conns = [Raw(agent, "attacker", None) for _ in range(8)]
        for c in conns:
            for _ in range(2):
                c.req += 1
                c.ch.send(protocol.GET, c.req, protocol.Blocks(keys, [size] * 4))
        for c in conns:
            c.ch.sock.recv(1 << 16)                 # the reply has started
            c.ch.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            c.ch.sock.close()
        own = protocol.META_LEN.size + 1 + protocol.MAC_BYTES + protocol.decoded_bound(
            protocol.STATS, 1) + protocol.reply_bound(protocol.STATS, protocol.Empty())
        assert wait_for(lambda: int(stats(attacker)["agent_memory_held_key"]) == own, 60), \
            stats(attacker)
    # The key is not locked out: its next inline GET of 15.6 MiB is served.
    reply, data = attacker.call(protocol.GET, protocol.Blocks(keys, [size] * 4))
    assert reply == protocol.Flags([True] * 4) and data.nbytes == 4 * size
