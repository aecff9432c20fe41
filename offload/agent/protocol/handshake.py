"""The handshake of the agent's protocol: each side sends `MAGIC | version | 16-byte nonce`, both
derive the connection's key `HMAC-SHA256(secret, LABEL | server_nonce | client_nonce)`.
`accept_hello` is the agent's side together with the first frame, a HELLO of at most
`PRE_AUTH_MAX_BODY` bytes, all under one deadline (`io_timeout`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time
from typing import Callable

import msgspec

from offload.agent.protocol.frames import (
    Channel,
    Frame,
    decoder,
    read_frame,
    recv_exact_into,
    send_parts,
    settimeout,
)
from offload.agent.protocol.messages import (
    DEFAULT_MAX_BODY,
    HANDSHAKE,
    HANDSHAKE_MAGIC,
    HEADER,
    HELLO,
    LABEL,
    META_LEN,
    NONCE_BYTES,
    OP_NAMES,
    PRE_AUTH_MAX_BODY,
    VERSION,
    AuthError,
    Hello,
    ProtocolError,
)


def _derive(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, LABEL + server_nonce + client_nonce, hashlib.sha256).digest()


def _read_hello(sock: socket.socket, deadline: float) -> bytes:
    buf = bytearray(HANDSHAKE.size)
    settimeout(sock, deadline)
    if sock.recv_into(memoryview(buf)[:1], 1) == 0:
        # A bare connect-and-close (a reachability probe such as `detect`) is not an attack.
        raise EOFError("peer closed before the handshake")
    recv_exact_into(sock, memoryview(buf)[1:], deadline)
    magic, version, nonce = HANDSHAKE.unpack(buf)
    if magic != HANDSHAKE_MAGIC:
        raise ProtocolError(f"not an sglang-offload agent peer (magic {bytes(magic)!r})")
    if version != VERSION:
        raise ProtocolError(f"peer speaks protocol version {version}, this side {VERSION}")
    return nonce


def handshake_server(sock: socket.socket, secret: bytes, io_timeout: float,
                     max_body: int = DEFAULT_MAX_BODY) -> Channel:
    deadline = time.monotonic() + io_timeout
    server_nonce = os.urandom(NONCE_BYTES)
    send_parts(sock, [HANDSHAKE.pack(HANDSHAKE_MAGIC, VERSION, server_nonce)], deadline)
    client_nonce = _read_hello(sock, deadline)
    return Channel(sock, _derive(secret, server_nonce, client_nonce), is_server=True,
                   io_timeout=io_timeout, max_body=max_body)


def accept_hello(sock: socket.socket, lookup: Callable[[str], bytes | None], io_timeout: float,
                 max_body: int = DEFAULT_MAX_BODY) -> tuple[Channel, Frame]:
    """The agent's handshake and first frame, all within `io_timeout`: a HELLO of at most
    `PRE_AUTH_MAX_BODY` bytes whose host name selects the secret (`lookup`; None: unknown host)
    and whose MAC must verify with it. Raises ProtocolError / AuthError / TimeoutError / EOFError."""
    deadline = time.monotonic() + io_timeout
    server_nonce = os.urandom(NONCE_BYTES)
    send_parts(sock, [HANDSHAKE.pack(HANDSHAKE_MAGIC, VERSION, server_nonce)], deadline)
    client_nonce = _read_hello(sock, deadline)
    settimeout(sock, deadline)
    first = sock.recv(1)
    if not first:
        raise EOFError("peer closed before its hello")
    header, body_len, view = read_frame(sock, first, PRE_AUTH_MAX_BODY, deadline)
    op = HEADER.unpack(header)[2]
    if op != HELLO:
        raise ProtocolError(f"first frame is {OP_NAMES.get(op, op)}, expected hello")
    (meta_len,) = META_LEN.unpack_from(view)
    if META_LEN.size + meta_len > body_len:
        raise ProtocolError(f"meta length {meta_len} runs past the body ({body_len} bytes)")
    try:     # read before the MAC is checked (it names the secret); verified just below
        claimed = decoder(Hello).decode(view[META_LEN.size:META_LEN.size + meta_len])
    except msgspec.MsgspecError as e:
        raise ProtocolError(f"bad hello body: {e}") from None
    secret = lookup(claimed.host)
    if secret is None:
        raise AuthError(f"unknown host {claimed.host!r} (not in the agent's keys file)")
    ch = Channel(sock, _derive(secret, server_nonce, client_nonce), is_server=True,
                 io_timeout=io_timeout, max_body=max_body)
    return ch, ch.open(header, body_len, view)


def handshake_client(sock: socket.socket, secret: bytes, io_timeout: float,
                     max_body: int = DEFAULT_MAX_BODY) -> Channel:
    deadline = time.monotonic() + io_timeout
    server_nonce = _read_hello(sock, deadline)
    client_nonce = os.urandom(NONCE_BYTES)
    send_parts(sock, [HANDSHAKE.pack(HANDSHAKE_MAGIC, VERSION, client_nonce)], deadline)
    return Channel(sock, _derive(secret, server_nonce, client_nonce), is_server=False,
                   io_timeout=io_timeout, max_body=max_body)
