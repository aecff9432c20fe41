"""Frames of the agent's protocol: the codec (`Frame.decode`, msgspec, no pickle) and `Channel`,
one authenticated connection end (MAC and sequence per direction). `read_frame` reads one frame
with its header checked (magic, version, `max_body`) before the body is read; `send_parts` /
`recv_exact_into` move bytes under one deadline for all of them.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import time
from dataclasses import dataclass
from typing import Callable, Type, TypeVar, cast

import msgspec

from offload.agent.protocol.messages import (
    DEFAULT_MAX_BODY,
    FRAME_MAGIC,
    HEADER,
    MAC_BYTES,
    MAX_META_BYTES,
    META_LEN,
    OP_NAMES,
    PROOF_LABEL,
    REPLY,
    REPLY_TYPES,
    REQUEST_TYPES,
    VERSION,
    AuthError,
    Msg,
    ProtocolError,
)

_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {t: msgspec.msgpack.Decoder(t) for t in set(REQUEST_TYPES.values()) |
             set(REPLY_TYPES.values())}
M = TypeVar("M", bound=Msg)


def decoder(typ: Type[M]) -> msgspec.msgpack.Decoder[M]:
    """The decoder of `typ` (`_DECODERS` holds one per message type, typed only as `Msg`)."""
    return cast("msgspec.msgpack.Decoder[M]", _DECODERS[typ])


@dataclass
class Frame:
    op: int
    flags: int
    req_id: int
    meta: memoryview
    payload: memoryview

    def decode(self, typ: Type[M]) -> M:
        try:
            return decoder(typ).decode(self.meta)
        except msgspec.MsgspecError as e:
            raise ProtocolError(f"bad {OP_NAMES.get(self.op & ~REPLY, self.op)} body: {e}") from None


class Channel:
    """One authenticated connection end. Not thread-safe: callers serialise send/recv."""

    def __init__(self, sock: socket.socket, key: bytes, *, is_server: bool, io_timeout: float,
                 max_body: int = DEFAULT_MAX_BODY):
        self.sock = sock
        self._key = key
        self._out_dir = b"S" if is_server else b"C"
        self._in_dir = b"C" if is_server else b"S"
        self.io_timeout = io_timeout
        self.max_body = max_body
        self._send_seq = 0
        self._recv_seq = 0
        # Called with a frame's body length before its body is allocated (raise to refuse it).
        self.admit: Callable[[int], None] | None = None

    def proof(self, nonce: bytes) -> bytes:
        """What the host writes into its registered memory for a proof nonce (PROVE)."""
        return hmac.new(self._key, PROOF_LABEL + nonce, hashlib.sha256).digest()

    def _mac(self, direction: bytes, *parts: bytes | bytearray | memoryview) -> bytes:
        h = hmac.new(self._key, direction, hashlib.sha256)
        for p in parts:
            h.update(p)
        return h.digest()

    def send(self, op: int, req_id: int, meta: Msg, payload: list[memoryview] | None = None,
             flags: int = 0, deadline: float | None = None) -> int:
        """Send one frame; returns its body's length once all of it is written."""
        encoded = _ENCODER.encode(meta)
        parts: list[bytes | memoryview] = [META_LEN.pack(len(encoded)), encoded]
        parts += payload or []
        body_len = sum(memoryview(p).nbytes for p in parts)
        if body_len > self.max_body:
            raise ProtocolError(f"frame body of {body_len} bytes exceeds the limit {self.max_body}")
        self._send_seq += 1
        header = HEADER.pack(FRAME_MAGIC, VERSION, op, flags, req_id, self._send_seq, body_len)
        mac = self._mac(self._out_dir, header, *parts)
        send_parts(self.sock, [header, *parts, mac],
                   deadline if deadline is not None else time.monotonic() + self.io_timeout)
        return body_len

    def recv(self, idle_timeout: float | None = None, deadline: float | None = None) -> Frame:
        """The next frame. Waits `idle_timeout` (default `io_timeout`) for it to start, then
        `io_timeout` for all of it; with `deadline` (a client waiting for its reply) the whole
        frame must have arrived by then."""
        if deadline is not None:
            settimeout(self.sock, deadline)
        else:
            self.sock.settimeout(idle_timeout if idle_timeout is not None else self.io_timeout)
        first = self.sock.recv(1)
        if not first:
            raise EOFError("peer closed the connection")
        end = deadline if deadline is not None else time.monotonic() + self.io_timeout
        header, body_len, view = read_frame(self.sock, first, self.max_body, end, self.admit)
        return self.open(header, body_len, view)

    def open(self, header: bytes | bytearray, body_len: int, view: memoryview) -> Frame:
        """Verify a frame read by `read_frame` (MAC, sequence, meta bound) and split its body."""
        _, _, op, flags, req_id, seq, _ = HEADER.unpack(header)
        mac = view[body_len:]
        if not hmac.compare_digest(self._mac(self._in_dir, header, view[:body_len]), mac):
            raise AuthError("frame MAC does not verify (wrong secret, tampered or replayed)")
        if seq != self._recv_seq + 1:
            raise AuthError(f"frame sequence {seq}, expected {self._recv_seq + 1} (replay?)")
        self._recv_seq = seq
        (meta_len,) = META_LEN.unpack_from(view)
        if META_LEN.size + meta_len > body_len:
            raise ProtocolError(f"meta length {meta_len} runs past the body ({body_len} bytes)")
        if meta_len > MAX_META_BYTES:
            raise ProtocolError(f"meta of {meta_len} bytes exceeds the limit {MAX_META_BYTES}")
        meta = view[META_LEN.size:META_LEN.size + meta_len]
        return Frame(op, flags, req_id, meta, view[META_LEN.size + meta_len:body_len])


def settimeout(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(left)


def read_frame(sock: socket.socket, first: bytes, max_body: int, deadline: float,
               admit: Callable[[int], None] | None = None) -> tuple[bytearray, int, memoryview]:
    """The rest of a frame whose first byte was read: (header, body length, body + MAC), all of
    it by `deadline`. The header is checked (magic, version, `max_body`) before the body is read."""
    header = bytearray(HEADER.size)
    header[0:1] = first
    recv_exact_into(sock, memoryview(header)[1:], deadline)
    magic, version, _, _, _, _, body_len = HEADER.unpack(header)
    if magic != FRAME_MAGIC:
        raise ProtocolError(f"bad frame magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} (this side speaks {VERSION})")
    if body_len > max_body:
        raise ProtocolError(f"frame body of {body_len} bytes exceeds the limit {max_body}")
    if body_len < META_LEN.size:
        raise ProtocolError(f"frame body of {body_len} bytes is too short")
    if admit is not None:
        admit(body_len)
    body = bytearray(body_len + MAC_BYTES)
    recv_exact_into(sock, memoryview(body), deadline)
    return header, body_len, memoryview(body)


def send_parts(sock: socket.socket, parts: list[bytes | memoryview], deadline: float) -> None:
    """Send every part by `deadline` (vectored; sendmsg may stop short on a socket with a
    timeout)."""
    views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
    while views:
        settimeout(sock, deadline)
        sent = sock.sendmsg(views[:64])
        while sent and views:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def recv_exact_into(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill `view` by `deadline` (one deadline for all of it, not one per recv)."""
    got = 0
    while got < view.nbytes:
        settimeout(sock, deadline)
        r = sock.recv_into(view[got:])
        if r == 0:
            raise ProtocolError(f"connection closed after {got} of {view.nbytes} bytes")
        got += r

