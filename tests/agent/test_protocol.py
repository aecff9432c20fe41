"""Frames and handshake in-process (socketpair): authentication, sequence, bounds, decoding."""

from __future__ import annotations

import os
import socket
import stat
import threading

import pytest

from offload.agent import protocol
from offload.agent.auth import load_secret
from offload.errors import ConfigError
from tests.agent.conftest import recording_sends

SECRET = b"s" * 32


def pair(server_secret: bytes = SECRET, client_secret: bytes = SECRET, max_body: int = 1 << 20):
    a, b = socket.socketpair()
    out: dict[str, protocol.Channel] = {}
    t = threading.Thread(target=lambda: out.setdefault(
        "s", protocol.handshake_server(a, server_secret, 2, max_body)))
    t.start()
    c = protocol.handshake_client(b, client_secret, 2, max_body)
    t.join()
    return out["s"], c


def test_roundtrip_with_payload() -> None:
    s, c = pair()
    c.send(protocol.PUT, 7, protocol.Blocks(keys=[b"k" * 32], sizes=[5]), [memoryview(b"hello")])
    f = s.recv()
    assert (f.op, f.req_id, bytes(f.payload)) == (protocol.PUT, 7, b"hello")
    assert f.decode(protocol.Blocks).sizes == [5]
    s.send(protocol.PUT | protocol.REPLY, 7, protocol.Flags([True]))
    assert c.recv().decode(protocol.Flags).ok == [True]


def test_wrong_secret_fails_mac() -> None:
    s, c = pair(client_secret=b"x" * 32)
    c.send(protocol.STATS, 1, protocol.Empty())
    with pytest.raises(protocol.AuthError):
        s.recv()


def test_direction_matters() -> None:
    """A server frame reflected back to the server does not verify."""
    s, c = pair()
    with recording_sends() as sent:
        s.send(protocol.STATS | protocol.REPLY, 1, protocol.StatsReply({}))
    c.recv()
    c.sock.sendall(sent[0])
    with pytest.raises(protocol.AuthError):
        s.recv()


def test_sequence_gap_rejected() -> None:
    s, c = pair()
    c._send_seq = 5          # skips 1..5: as if frames were dropped or reordered
    c.send(protocol.STATS, 1, protocol.Empty())
    with pytest.raises(protocol.AuthError, match="sequence"):
        s.recv()


def test_oversized_refused_without_reading_body() -> None:
    s, c = pair(max_body=1024)
    c.sock.sendall(protocol.HEADER.pack(protocol.FRAME_MAGIC, protocol.VERSION, protocol.PUT, 0, 1, 1,
                                        1 << 31))
    with pytest.raises(protocol.ProtocolError, match="exceeds the limit"):
        s.recv()
    with pytest.raises(protocol.ProtocolError, match="exceeds the limit"):
        c.send(protocol.PUT, 1, protocol.Blocks(keys=[], sizes=[]), [memoryview(bytes(2048))])


def test_truncated_and_eof() -> None:
    s, c = pair()
    c.sock.sendall(protocol.HEADER.pack(protocol.FRAME_MAGIC, protocol.VERSION, protocol.PUT, 0, 1, 1, 100)
                   + b"abc")
    c.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(protocol.ProtocolError, match="connection closed after"):
        s.recv()
    s2, c2 = pair()
    c2.sock.close()
    with pytest.raises(EOFError):
        s2.recv()


def test_bad_magic_and_version() -> None:
    s, c = pair()
    c.sock.sendall(protocol.HEADER.pack(b"XXXX", protocol.VERSION, protocol.PUT, 0, 1, 1, 10))
    with pytest.raises(protocol.ProtocolError, match="magic"):
        s.recv()
    s, c = pair()
    c.sock.sendall(protocol.HEADER.pack(protocol.FRAME_MAGIC, 99, protocol.PUT, 0, 1, 1, 10))
    with pytest.raises(protocol.ProtocolError, match="version"):
        s.recv()


def test_typed_decoding_rejects_bad_bodies() -> None:
    s, c = pair()
    c.send(protocol.EXISTS, 1, protocol.KeyList([b"short"]))   # keys must be 32 bytes
    with pytest.raises(protocol.ProtocolError, match="bad exists body"):
        s.recv().decode(protocol.KeyList)

    class Extra(protocol.Msg):
        keys: list[bytes]
        evil: int

    c.send(protocol.EXISTS, 2, Extra([b"k" * 32], 1))   # unknown fields are refused
    with pytest.raises(protocol.ProtocolError):
        s.recv().decode(protocol.KeyList)


def test_secret_sources(tmp_path) -> None:
    f = tmp_path / "secret"
    f.write_bytes(b"  abcdefghijklmnopqrstuvwxyz\n")
    f.chmod(0o600)
    assert load_secret(str(f)) == b"abcdefghijklmnopqrstuvwxyz"
    f.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_secret(str(f))
    with pytest.raises(ConfigError, match="cannot read"):
        load_secret(str(tmp_path / "missing"))
    assert load_secret(env={"SGLANG_OFFLOAD_SECRET": "0123456789abcdef"}) == b"0123456789abcdef"
    with pytest.raises(ConfigError, match="at least 16"):
        load_secret(env={"SGLANG_OFFLOAD_SECRET": "short"})
    with pytest.raises(ConfigError, match="no agent secret"):
        load_secret(env={})
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o644
