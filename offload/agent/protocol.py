"""The agent's control protocol: a handshake, then authenticated, size-bounded, versioned frames.

Primitives:
- `handshake_server(sock, secret)` / `handshake_client(sock, secret)` -> `Channel`: each side sends
  `MAGIC | version | 16-byte nonce`; both derive a per-connection key
  `HMAC-SHA256(secret, LABEL | server_nonce | client_nonce)`, so a frame recorded on one connection
  is worthless on another.
- `Channel.send(op, req_id, meta, payload)` / `Channel.recv(idle_timeout)` -> `Frame`. A frame is a
  fixed header `!4sBBHQQI` (magic, version, op, flags, request id, sequence, body length), the body,
  and an HMAC-SHA256 over (direction | header | body). Sequence numbers start at 1 per direction and
  must increase by one (no replay, no reorder). The body length is checked against `max_body`
  *before* the body is read. The body is `u32 meta length | msgpack meta | raw payload`; the meta is
  decoded with msgspec into the op's typed Struct (no pickle, unknown fields rejected).
- `ProtocolError` (malformed, oversized, truncated, wrong version) and `AuthError` (bad MAC): the
  receiver closes the connection; the agent logs the reason and keeps serving everyone else.
Every socket operation has a timeout: `io_timeout` once a frame has started, `idle_timeout` while
waiting for the next one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from dataclasses import dataclass
from typing import Annotated, Sequence, Type, TypeVar

import msgspec

from offload.errors import OffloadError

VERSION = 1
HANDSHAKE_MAGIC = b"SGLA"
FRAME_MAGIC = b"SGLF"
LABEL = b"sglang-offload-agent-v1"
NONCE_BYTES = 16
MAC_BYTES = 32
HANDSHAKE = struct.Struct("!4sB16s")
HEADER = struct.Struct("!4sBBHQQI")
META_LEN = struct.Struct("!I")
DEFAULT_MAX_BODY = 64 << 20
MAX_KEYS = 4096
MAX_DESCS_PER_BLOCK = 1024

# Ops. A reply carries the request's op with REPLY set; ERROR replies to anything.
HELLO, PUT, GET, EXISTS, DELETE, STATS, REGISTER_NS, METADATA = 1, 2, 3, 4, 5, 6, 7, 8
ERROR = 0x7F
REPLY = 0x80
OP_NAMES = {HELLO: "hello", PUT: "put", GET: "get", EXISTS: "exists", DELETE: "delete",
            STATS: "stats", REGISTER_NS: "register_ns", METADATA: "metadata", ERROR: "error"}


class ProtocolError(OffloadError):
    """A frame is malformed, oversized, truncated, out of sequence or of another version."""


class AuthError(ProtocolError):
    """A frame's MAC does not verify: wrong secret, tampering or replay."""


Key = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS)]
Size = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
Desc = tuple[Annotated[int, msgspec.Meta(ge=0)], Size]   # (address, length)
BlockDescs = Annotated[list[Desc], msgspec.Meta(max_length=MAX_DESCS_PER_BLOCK)]


class Msg(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    pass


class Hello(Msg):
    host: Annotated[str, msgspec.Meta(max_length=256)]
    transport: Annotated[str, msgspec.Meta(pattern="^(ucx|tcp)$")]
    nixl_md: bytes | None = None


class HelloReply(Msg):
    agent: str
    max_body: int
    max_keys: int
    max_block: int
    nixl: bool


class Blocks(Msg):
    """PUT and GET: block keys and sizes; `descs` (host memory, one list per block) when NIXL moves
    the bytes, else the bytes travel as the frame payload (PUT request / GET reply)."""
    keys: Keys
    sizes: Annotated[list[Size], msgspec.Meta(max_length=MAX_KEYS)]
    descs: Annotated[list[BlockDescs], msgspec.Meta(max_length=MAX_KEYS)] | None = None
    budget_ms: Annotated[int, msgspec.Meta(ge=1, le=3_600_000)] = 30_000


class KeyList(Msg):
    keys: Keys


class Flags(Msg):
    ok: list[bool]


class Count(Msg):
    n: int


class Empty(Msg):
    pass


class StatsReply(Msg):
    fields: dict[str, int | float | str]


class NamespaceMsg(Msg):
    fields: dict[str, int | str | bool]


class Metadata(Msg):
    nixl_md: bytes


class ErrorReply(Msg):
    message: str


REQUEST_TYPES: dict[int, Type[Msg]] = {
    HELLO: Hello, PUT: Blocks, GET: Blocks, EXISTS: KeyList, DELETE: KeyList, STATS: Empty,
    REGISTER_NS: NamespaceMsg, METADATA: Metadata,
}
REPLY_TYPES: dict[int, Type[Msg]] = {
    HELLO: HelloReply, PUT: Flags, GET: Flags, EXISTS: Flags, DELETE: Count, STATS: StatsReply,
    REGISTER_NS: Empty, METADATA: Empty, ERROR: ErrorReply,
}
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {t: msgspec.msgpack.Decoder(t) for t in set(REQUEST_TYPES.values()) |
             set(REPLY_TYPES.values())}
M = TypeVar("M", bound=Msg)


@dataclass
class Frame:
    op: int
    flags: int
    req_id: int
    meta: memoryview
    payload: memoryview

    def decode(self, typ: Type[M]) -> M:
        try:
            return _DECODERS[typ].decode(self.meta)
        except msgspec.MsgspecError as e:
            raise ProtocolError(f"bad {OP_NAMES.get(self.op & ~REPLY, self.op)} body: {e}") from None


def recv_exact(sock: socket.socket, n: int, into: bytearray | None = None) -> bytearray:
    """Read exactly n bytes (socket timeout applies to each recv); EOF midway is ProtocolError."""
    buf = into if into is not None else bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        r = sock.recv_into(view[got:n], n - got)
        if r == 0:
            raise ProtocolError(f"connection closed after {got} of {n} bytes")
        got += r
    return buf


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

    def _mac(self, direction: bytes, *parts: bytes | memoryview) -> bytes:
        h = hmac.new(self._key, direction, hashlib.sha256)
        for p in parts:
            h.update(p)
        return h.digest()

    def send(self, op: int, req_id: int, meta: Msg, payload: list[memoryview] | None = None,
             flags: int = 0) -> None:
        encoded = _ENCODER.encode(meta)
        parts: list[bytes | memoryview] = [META_LEN.pack(len(encoded)), encoded]
        parts += payload or []
        body_len = sum(memoryview(p).nbytes for p in parts)
        if body_len > self.max_body:
            raise ProtocolError(f"frame body of {body_len} bytes exceeds the limit {self.max_body}")
        self._send_seq += 1
        header = HEADER.pack(FRAME_MAGIC, VERSION, op, flags, req_id, self._send_seq, body_len)
        mac = self._mac(self._out_dir, header, *parts)
        self.sock.settimeout(self.io_timeout)
        send_parts(self.sock, [header, *parts, mac])

    def recv(self, idle_timeout: float | None = None) -> Frame:
        self.sock.settimeout(idle_timeout if idle_timeout is not None else self.io_timeout)
        first = self.sock.recv(1)
        if not first:
            raise EOFError("peer closed the connection")
        self.sock.settimeout(self.io_timeout)
        header = bytearray(HEADER.size)
        header[0:1] = first
        recv_exact_into(self.sock, memoryview(header)[1:])
        magic, version, op, flags, req_id, seq, body_len = HEADER.unpack(header)
        if magic != FRAME_MAGIC:
            raise ProtocolError(f"bad frame magic {bytes(magic)!r}")
        if version != VERSION:
            raise ProtocolError(f"protocol version {version} (this side speaks {VERSION})")
        if body_len > self.max_body:
            raise ProtocolError(f"frame body of {body_len} bytes exceeds the limit {self.max_body}")
        if body_len < META_LEN.size:
            raise ProtocolError(f"frame body of {body_len} bytes is too short")
        body = recv_exact(self.sock, body_len + MAC_BYTES)
        view = memoryview(body)
        mac = view[body_len:]
        if not hmac.compare_digest(self._mac(self._in_dir, header, view[:body_len]), mac):
            raise AuthError("frame MAC does not verify (wrong secret, tampered or replayed)")
        if seq != self._recv_seq + 1:
            raise AuthError(f"frame sequence {seq}, expected {self._recv_seq + 1} (replay?)")
        self._recv_seq = seq
        (meta_len,) = META_LEN.unpack_from(view)
        if META_LEN.size + meta_len > body_len:
            raise ProtocolError(f"meta length {meta_len} runs past the body ({body_len} bytes)")
        meta = view[META_LEN.size:META_LEN.size + meta_len]
        return Frame(op, flags, req_id, meta, view[META_LEN.size + meta_len:body_len])


def send_parts(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    """Send every part (vectored; sendmsg may stop short on a socket with a timeout)."""
    views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
    while views:
        sent = sock.sendmsg(views[:64])
        while sent and views:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        r = sock.recv_into(view[got:])
        if r == 0:
            raise ProtocolError(f"connection closed after {got} of {view.nbytes} bytes")
        got += r


def _derive(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, LABEL + server_nonce + client_nonce, hashlib.sha256).digest()


def _read_hello(sock: socket.socket) -> bytes:
    buf = bytearray(HANDSHAKE.size)
    if sock.recv_into(memoryview(buf)[:1], 1) == 0:
        # A bare connect-and-close (a reachability probe such as `detect`) is not an attack.
        raise EOFError("peer closed before the handshake")
    recv_exact_into(sock, memoryview(buf)[1:])
    magic, version, nonce = HANDSHAKE.unpack(buf)
    if magic != HANDSHAKE_MAGIC:
        raise ProtocolError(f"not an sglang-offload agent peer (magic {bytes(magic)!r})")
    if version != VERSION:
        raise ProtocolError(f"peer speaks protocol version {version}, this side {VERSION}")
    return nonce


def handshake_server(sock: socket.socket, secret: bytes, io_timeout: float,
                     max_body: int = DEFAULT_MAX_BODY) -> Channel:
    sock.settimeout(io_timeout)
    server_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(HANDSHAKE.pack(HANDSHAKE_MAGIC, VERSION, server_nonce))
    client_nonce = _read_hello(sock)
    return Channel(sock, _derive(secret, server_nonce, client_nonce), is_server=True,
                   io_timeout=io_timeout, max_body=max_body)


def handshake_client(sock: socket.socket, secret: bytes, io_timeout: float,
                     max_body: int = DEFAULT_MAX_BODY) -> Channel:
    sock.settimeout(io_timeout)
    server_nonce = _read_hello(sock)
    client_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(HANDSHAKE.pack(HANDSHAKE_MAGIC, VERSION, client_nonce))
    return Channel(sock, _derive(secret, server_nonce, client_nonce), is_server=False,
                   io_timeout=io_timeout, max_body=max_body)


def pack(idx: Sequence[int], sizes: Sequence[int], max_bytes: int,
         max_keys: int | None = None) -> list[list[int]]:
    """Indices in order, cut into groups of at most `max_bytes` (and `max_keys`); a block larger
    than `max_bytes` gets a group of its own. Requests (client) and staging groups (agent)."""
    out: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in idx:
        if cur and (used + sizes[i] > max_bytes or (max_keys is not None and len(cur) >= max_keys)):
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += sizes[i]
    if cur:
        out.append(cur)
    return out
