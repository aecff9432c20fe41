"""A bounded fuzz of the agent's parsing, before and after authentication, against a real process.

Random bytes after the nonce exchange, random frame headers and bodies before a verified HELLO,
and authenticated frames with random ops, msgpack metas and payloads. Whatever each does to its
own connection, the agent must survive and keep serving a real client afterwards.
"""

from __future__ import annotations

import os
import socket

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload.agent import protocol
from offload.agent.client import AgentStore
from tests.agent.conftest import SECRET
from tests.agent.tenants import send_meta

pytestmark = pytest.mark.slow

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
leaf = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
                 st.binary(max_size=40), st.text(max_size=20))
values = st.recursive(leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.dictionaries(st.sampled_from(
        ["keys", "sizes", "descs", "budget_ms", "host", "transport", "nixl_md", "digest", "model",
         "page_size", "salted", "x"]), inner, max_size=6)), max_leaves=30)
metas = st.one_of(st.binary(max_size=300), values.map(msgspec.msgpack.encode))


def _drain(sock: socket.socket) -> None:
    sock.settimeout(0.2)
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass
    sock.close()


def _serves(agent) -> None:
    s = AgentStore(agent.address, SECRET, transport="tcp", timeout_s=5, reconnect_s=0.1)
    k = os.urandom(32)
    buf = bytearray(4)
    try:
        assert s.put_many([k], [[b"live"]]) == [True]
        assert s.get_many([k], [[buf]]) == [True] and bytes(buf) == b"live"
    finally:
        s.close()


def test_fuzz_pre_and_post_authentication(agent_factory) -> None:
    agent = agent_factory("--memory", "--transport", "tcp", "--io-timeout", "2",
                          "--max-pending", "64")

    @FUZZ
    @given(junk=st.binary(max_size=200), op=st.integers(0, 255), length=st.integers(0, (1 << 32) - 1),
           body=st.binary(max_size=300), nonce_first=st.booleans())
    def pre_auth(junk: bytes, op: int, length: int, body: bytes, nonce_first: bool) -> None:
        sock = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
        try:
            sock.recv(protocol.HANDSHAKE.size)
            if nonce_first:
                sock.sendall(protocol.HANDSHAKE.pack(protocol.HANDSHAKE_MAGIC, protocol.VERSION,
                                                     os.urandom(16)))
                sock.sendall(protocol.HEADER.pack(protocol.FRAME_MAGIC, protocol.VERSION, op, 0, 1,
                                                  1, length % (1 << 32)) + body)
            else:
                sock.sendall(junk)
        except OSError:
            pass
        _drain(sock)

    @FUZZ
    @given(op=st.integers(0, 255), meta=metas, payload=st.binary(max_size=200))
    def post_auth(op: int, meta: bytes, payload: bytes) -> None:
        sock = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
        ch = protocol.handshake_client(sock, SECRET, io_timeout=5)
        ch.send(protocol.HELLO, 1, protocol.Hello(host="fuzz", transport="tcp"))
        ch.recv()
        try:
            send_meta(ch, op, 2, meta + payload)
        except OSError:
            pass
        _drain(sock)

    pre_auth()
    _serves(agent)
    post_auth()
    _serves(agent)
    assert agent.proc.poll() is None
    assert "Traceback" not in agent.text(), "a frame hit an unexpected exception"
