"""Bad clients against a real agent process: each is rejected and logged; good clients keep working.

Every test first checks that the bad request did not take effect (a block a forged request tried to
store is absent), so it fails if authentication or bounds checking broke.
"""

from __future__ import annotations

import os
import socket

import pytest

from offload.agent import protocol
from offload.agent.client import AgentStore
from offload.agent.protocol import frames
from tests.agent.conftest import SECRET, recording_sends, wait_for
from tests.agent.tenants import closed_by_peer

KEY = b"K" * 32


@pytest.fixture
def agent(agent_factory):
    a = agent_factory("--memory", "--transport", "tcp", "--max-frame", "1MiB")
    # A host connected before the attack keeps its own connection and service throughout.
    bystander = good(a)
    assert bystander.put_many([b"B" * 32], [[b"before"]]) == [True]
    channel = bystander._conns[0].ch
    assert channel is not None
    yield a
    assert bystander._conns[0].ch is channel, "the bystander's connection was dropped"
    assert bystander.get_bytes_ok(), "the bystander lost service"
    bystander.close()


class Bystander(AgentStore):
    def get_bytes_ok(self) -> bool:
        buf = bytearray(6)
        return self.get_many([b"B" * 32], [[buf]]) == [True] and bytes(buf) == b"before"


def good(agent) -> Bystander:
    return Bystander(agent.address, SECRET, transport="tcp", timeout_s=5, reconnect_s=0.1)


def raw(agent, secret: bytes = SECRET) -> protocol.Channel:
    sock = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
    return protocol.handshake_client(sock, secret, io_timeout=5)


def hello(ch: protocol.Channel) -> None:
    ch.send(protocol.HELLO, 1, protocol.Hello(host="raw", transport="tcp"))
    assert ch.recv().op == protocol.HELLO | protocol.REPLY


def assert_still_serving(agent) -> None:
    s = good(agent)
    try:
        assert s.put_many([b"G" * 32], [[b"good" * 100]]) == [True]
        assert s.exists_many([KEY]) == [False], "a rejected request took effect"
    finally:
        s.close()


def test_wrong_secret_rejected_and_logged(agent) -> None:
    bad = AgentStore(agent.address, b"not-the-secret-at-all", transport="tcp", timeout_s=2)
    assert bad.put_many([KEY], [[b"x" * 64]]) == [False]
    assert bad.exists_many([KEY]) == [False]
    assert wait_for(lambda: "unauthenticated" in agent.text())
    assert_still_serving(agent)


def test_tampered_frame_rejected(agent) -> None:
    ch = raw(agent)
    hello(ch)
    # A valid PUT whose payload is flipped after the MAC was computed.
    meta = protocol.Blocks(keys=[KEY], sizes=[4])
    real_send = frames.send_parts

    def tamper(sock, parts, *rest):
        parts = list(parts)
        parts[-2] = b"EVIL"          # the payload, just before the MAC
        real_send(sock, parts, *rest)

    frames.send_parts = tamper
    try:
        ch.send(protocol.PUT, 2, meta, [memoryview(b"good")])
    finally:
        frames.send_parts = real_send
    assert closed_by_peer(ch.sock)
    assert wait_for(lambda: "frame MAC does not verify" in agent.text())
    assert_still_serving(agent)


def test_replayed_frame_rejected(agent) -> None:
    ch = raw(agent)
    with recording_sends() as sent:
        hello(ch)
        ch.send(protocol.EXISTS, 2, protocol.KeyList([KEY]))
        assert ch.recv().op == protocol.EXISTS | protocol.REPLY
    ch.sock.sendall(sent[-1])          # the same EXISTS frame again
    assert closed_by_peer(ch.sock)
    assert wait_for(lambda: "replay" in agent.text())
    # And on a new connection (other nonces) the recorded frame is just as worthless.
    ch2 = raw(agent)
    ch2.sock.sendall(sent[0])
    assert closed_by_peer(ch2.sock)
    assert_still_serving(agent)


def test_oversized_frame_rejected_before_body(agent) -> None:
    ch = raw(agent)
    hello(ch)
    header = protocol.HEADER.pack(protocol.FRAME_MAGIC, protocol.VERSION, protocol.PUT, 0, 2, 2, 1 << 30)
    ch.sock.sendall(header)           # announces 1 GiB, sends nothing more
    assert closed_by_peer(ch.sock)    # closed at once, not after reading (or waiting for) 1 GiB
    assert wait_for(lambda: "exceeds the limit" in agent.text())
    assert_still_serving(agent)


def test_oversized_request_from_client_is_a_miss(agent) -> None:
    s = good(agent)
    try:
        big = bytearray(2 << 20)       # larger than the agent's 1 MiB frames allow per block
        assert s.put_many([KEY], [[big]]) == [False]
        assert s.put_many([b"s" * 32], [[b"small"]]) == [True]
    finally:
        s.close()


def test_truncated_frame_rejected(agent_factory) -> None:
    a = agent_factory("--memory", "--transport", "tcp", "--io-timeout", "1")
    ch = raw(a)
    hello(ch)
    header = protocol.HEADER.pack(protocol.FRAME_MAGIC, protocol.VERSION, protocol.PUT, 0, 2, 2, 1000)
    ch.sock.sendall(header + b"\0" * 100)     # 100 of 1000 body bytes, then silence
    assert closed_by_peer(ch.sock)
    assert wait_for(lambda: "timed out" in a.text())
    ch = raw(a)
    hello(ch)
    ch.sock.sendall(header + b"\0" * 100)
    ch.sock.close()                            # ... or the connection ends midway
    assert wait_for(lambda: "connection closed after" in a.text())
    assert_still_serving(a)


@pytest.mark.parametrize("junk", [b"GET / HTTP/1.1\r\nHost: agent\r\n\r\n", os.urandom(200),
                                  b"\0" * 64])
def test_garbage_rejected(agent, junk: bytes) -> None:
    sock = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
    sock.recv(protocol.HANDSHAKE.size)
    sock.sendall(junk)
    assert closed_by_peer(sock)
    assert wait_for(lambda: "rejected" in agent.text())
    assert_still_serving(agent)


def test_garbage_body_with_valid_mac_rejected(agent) -> None:
    """Authenticated but malformed (a client bug): the typed decoder refuses it."""
    ch = raw(agent)
    hello(ch)

    class Wrong(protocol.Msg):
        keys: list[str]

    ch.send(protocol.PUT, 2, Wrong(keys=["not bytes"]))
    assert closed_by_peer(ch.sock)
    assert wait_for(lambda: "bad put body" in agent.text())
    assert_still_serving(agent)


def test_wrong_version_rejected(agent) -> None:
    sock = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
    sock.recv(protocol.HANDSHAKE.size)
    sock.sendall(protocol.HANDSHAKE.pack(protocol.HANDSHAKE_MAGIC, protocol.VERSION + 1, b"n" * 16))
    assert closed_by_peer(sock)
    assert wait_for(lambda: "protocol version" in agent.text())
    assert_still_serving(agent)


def test_inconsistent_request_refused_connection_kept(agent) -> None:
    ch = raw(agent)
    hello(ch)
    ch.send(protocol.PUT, 2, protocol.Blocks(keys=[KEY], sizes=[10]), [memoryview(b"short")])
    reply = ch.recv()
    assert reply.op == protocol.ERROR | protocol.REPLY
    assert "payload" in reply.decode(protocol.ErrorReply).message
    ch.send(protocol.EXISTS, 3, protocol.KeyList([KEY]))            # same connection still served
    assert ch.recv().decode(protocol.Flags).ok == [False]
    assert_still_serving(agent)


def test_reachability_probe_is_not_logged_as_an_attack(agent) -> None:
    """`detect` opens and closes a TCP connection to see that the agent is there."""
    sock = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
    sock.close()
    assert_still_serving(agent)
    assert "rejected" not in agent.text()
