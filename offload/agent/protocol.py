"""The agent's control protocol: a handshake, then authenticated, size-bounded, versioned frames.

Primitives:
- `handshake_server(sock, secret)` / `handshake_client(sock, secret)` -> `Channel`: each side sends
  `MAGIC | version | 16-byte nonce`; both derive a per-connection key
  `HMAC-SHA256(secret, LABEL | server_nonce | client_nonce)`, so a frame recorded on one connection
  is worthless on another.
- `accept_hello(sock, lookup, io_timeout, max_body)` -> (`Channel`, HELLO `Frame`): the agent's side of
  the handshake *and* the first frame, which must be a HELLO of at most `PRE_AUTH_MAX_BODY` bytes;
  its (still unauthenticated) host name selects the secret (`lookup(host)`, per-host credentials),
  then its MAC is verified with the key derived from that secret. Everything before a verified
  HELLO shares one deadline (`io_timeout`), so a peer trickling bytes is cut off.
- `Channel.send(op, req_id, meta, payload)` / `Channel.recv(idle_timeout)` -> `Frame`. A frame is a
  fixed header `!4sBBHQQI` (magic, version, op, flags, request id, sequence, body length), the body,
  and an HMAC-SHA256 over (direction | header | body). Sequence numbers start at 1 per direction and
  must increase by one (no replay, no reorder). The body length is checked against `max_body`
  *before* the body is read. The body is `u32 meta length | msgpack meta | raw payload`; the meta is
  decoded with msgspec into the op's typed Struct (no pickle, unknown fields rejected).
- Proof of possession of a NIXL endpoint (version 3): the agent answers HELLO / METADATA that
  carry NIXL metadata with `nixl=True` only after it loaded the metadata and sent a fresh nonce
  to that endpoint as a NIXL notification (`PROOF_MAGIC | HelloReply.proof_tag | nonce`); the
  host writes `Channel.proof(nonce)` (an HMAC under this connection's key) into memory it
  registered and sends PROVE (the nonce, that address); the agent READs it back through the
  endpoint, and only a match makes descriptors accepted. An observer who read the nonce on the
  wire can echo it but cannot place the MAC in the endpoint's memory.
- Acknowledgements (version 4): a PUT's True means the agent has the block (stored unless its
  write or commit fails, and invisible to everyone until durable); DURABLE asks which keys are
  durable.
- Block checksums (version 5): a PUT with descriptors carries each block's checksum
  (`Blocks.sums`), checked by the agent after its READ; a GET reply carries the checksum of each
  block the agent wrote (`Flags.sums`), checked by the host before it reports the block loaded
  (`offload.agent.sums`).
- `ProtocolError` (malformed, oversized, truncated, wrong version) and `AuthError` (bad MAC): the
  receiver closes the connection; the agent logs the reason and keeps serving everyone else.
Requests (what the agent, `offload.agent.session`, does with each; one frame, one reply):
- PUT with descriptors: NIXL READs the blocks from host memory into staging (half A) while the
  store writes the previous group (half B); blocks the store already holds are not read at all.
  With a store arena (`AgentServer.arena()`) NIXL READs straight into reserved slots, committed after.
  A PUT is acknowledged once its blocks are written (through staging: once read into staging,
  their write still running, `StagedPath.put`); a store that commits in the background (the disk
  store) makes them durable later, and until then `AgentServer.acks` hides them from everyone:
  EXISTS says no, a GET waits for them (briefly, then misses). DURABLE waits for them and says
  per key whether it is durable. With `Blocks.sums` (version 5) a block whose READ landed bytes
  of another checksum is not stored.
- GET with descriptors: the store reads a group into staging while NIXL WRITEs the previous group
  into host memory. A block is reported True only after its WRITE completed, with the checksum
  of what was written (`Flags.sums`, version 5) for the host to check. With a store arena NIXL
  WRITEs straight from the pinned slots.
- PUT/GET without descriptors (`--transport tcp`, or memory the host did not register): the bytes
  travel as the frame payload.
- ANNOUNCE / FEED (version 6): the announcement feed (`offload.agent.feed`): a host announces
  the (block key, block hash, parent hash) of pages it stored; the agent records those whose
  namespace the host may use and whose block it holds durably, at most `feed.PER_TENANT` per
  host key; FEED returns the pages of one namespace the host may use after a cursor, at most
  `MAX_KEYS` a request. Replicas sharing the agent name each other's pages in KV events.
- DURABLE, EXISTS, DELETE, STATS, REGISTER_NS (checked against the host's grants,
  `AgentServer.access`), METADATA (newer NIXL metadata of this connection; the peer it replaces
  is released), PROVE (the nonce sent to the endpoint, echoed; the MAC of it under this
  connection's key, read back through the endpoint at the address given). Requests with
  descriptors (and PROVE) are refused while the host key's quarantined transfers hold
  `--max-quarantine` bytes.
Deadlines cover whole frames, not single `recv` calls: a started frame must be complete within
`io_timeout` (`recv`), and a client waits for its reply until its request's deadline
(`recv(deadline=...)`, `send(deadline=...)`); `idle_timeout` bounds the wait for the next frame.
The msgpack meta of a frame is at most `MAX_META_BYTES` (checked before decoding: the decoded size
of a request is bounded by it) and a request names at most `MAX_DESCS_PER_REQUEST` descriptors.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Annotated, Callable, Sequence, Type, TypeVar, cast

import msgspec

from offload.errors import OffloadError

VERSION = 6                        # 2: PROVE (proof of possession of a NIXL endpoint); 3: its MAC
                                   # is read back from the endpoint's memory (`Prove.addr`); 4: a
                                   # PUT's True means received, not durable (DURABLE asks for it);
                                   # 5: block checksums beside PUT / GET (`Blocks.sums`, `Flags.sums`);
                                   # 6: the announcement feed (ANNOUNCE, FEED)
HANDSHAKE_MAGIC = b"SGLA"
FRAME_MAGIC = b"SGLF"
LABEL = b"sglang-offload-agent-v1"
NONCE_BYTES = 16
MAC_BYTES = 32
HANDSHAKE = struct.Struct("!4sB16s")
HEADER = struct.Struct("!4sBBHQQI")
META_LEN = struct.Struct("!I")
DEFAULT_MAX_BODY = 64 << 20
PRE_AUTH_MAX_BODY = 64 << 10       # a HELLO before its MAC is verified (larger NIXL md: METADATA)
MAX_META_BYTES = 1 << 20           # msgpack meta of one frame (bounds a request's decoded size)
MAX_KEYS = 4096
MAX_DESCS_PER_BLOCK = 1024
MAX_DESCS_PER_REQUEST = 32768
PROOF_MAGIC = b"SGLP"               # a proof notification: magic | 16-byte tag | 32-byte nonce
PROOF_TAG_BYTES = 16
PROOF_NONCE_BYTES = 32
PROOF_MAC_BYTES = 32                # `Channel.proof`: one per nonce of a PROVE, back to back
PROOF_LABEL = b"sglang-offload-proof-v2"
MAX_PROOF_NONCES = 8
HOST_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._@:-]{0,127}$"   # no '/', spaces, quotes or control chars

# Ops. A reply carries the request's op with REPLY set; ERROR replies to anything.
HELLO, PUT, GET, EXISTS, DELETE, STATS, REGISTER_NS, METADATA, PROVE, DURABLE, ANNOUNCE, FEED = \
    range(1, 13)
ERROR = 0x7F
REPLY = 0x80
OP_NAMES = {HELLO: "hello", PUT: "put", GET: "get", EXISTS: "exists", DELETE: "delete",
            STATS: "stats", REGISTER_NS: "register_ns", METADATA: "metadata", PROVE: "prove",
            DURABLE: "durable", ANNOUNCE: "announce", FEED: "feed", ERROR: "error"}


class ProtocolError(OffloadError):
    """A frame is malformed, oversized, truncated, out of sequence or of another version."""


class AuthError(ProtocolError):
    """A frame's MAC does not verify: wrong secret, tampering or replay."""


Key = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS)]
Size = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
Sum = Annotated[int, msgspec.Meta(ge=0)]           # an xxh3-64 block checksum (a u64)
Desc = tuple[Annotated[int, msgspec.Meta(ge=0)], Size]   # (address, length)
BlockDescs = Annotated[list[Desc], msgspec.Meta(max_length=MAX_DESCS_PER_BLOCK)]


class Msg(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Every message. msgspec passes `frozen` on to subclasses; each says it again for type
    checkers, which (PEP 681) read a dataclass-like class's options from its own header."""


HostName = Annotated[str, msgspec.Meta(pattern=HOST_PATTERN)]


class Hello(Msg, frozen=True):
    host: HostName
    transport: Annotated[str, msgspec.Meta(pattern="^(ucx|tcp)$")]
    nixl_md: bytes | None = None


class HelloReply(Msg, frozen=True):
    """`nixl`: the agent loaded this host's NIXL metadata and sent it a proof notification tagged
    `proof_tag`; descriptors are accepted once the host echoed its nonce (PROVE)."""
    agent: str
    max_body: int
    max_keys: int
    max_block: int
    nixl: bool
    proof_tag: bytes = b""


Budget = Annotated[int, msgspec.Meta(ge=1, le=3_600_000)]     # ms the agent may work on it


class Blocks(Msg, frozen=True):
    """PUT and GET: block keys and sizes; `descs` (host memory, one list per block) when NIXL moves
    the bytes, else the bytes travel as the frame payload (PUT request / GET reply). A PUT's
    reply flag True means the agent has the block (written, or being written from staging): stored
    unless that write or its commit fails, and invisible to everyone (EXISTS, GET, after a
    crash) until durable; DURABLE waits for that."""
    keys: Keys
    sizes: Annotated[list[Size], msgspec.Meta(max_length=MAX_KEYS)]
    descs: Annotated[list[BlockDescs], msgspec.Meta(max_length=MAX_KEYS)] | None = None
    budget_ms: Budget = 30_000
    # PUT with descriptors: each block's checksum, checked by the agent after its READ
    # (`offload.agent.sums`); None: not checked.
    sums: Annotated[list[Sum], msgspec.Meta(max_length=MAX_KEYS)] | None = None


class Durable(Msg, frozen=True):
    """DURABLE: per key (reply `Flags`), whether it is stored durably, once the puts of it the
    agent acknowledged so far were made durable or lost (waiting at most `budget_ms`)."""
    keys: Keys
    budget_ms: Budget = 30_000


class KeyList(Msg, frozen=True):
    keys: Keys


class Flags(Msg, frozen=True):
    ok: list[bool]
    # GET with descriptors: per block the checksum of what the agent wrote (0 for a miss),
    # checked by the host before it reports the block loaded (`offload.agent.sums`).
    sums: list[Sum] | None = None


class Count(Msg, frozen=True):
    n: int


class Empty(Msg, frozen=True):
    pass


class StatsReply(Msg, frozen=True):
    fields: dict[str, int | float | str]


Small = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
Label = Annotated[str, msgspec.Meta(max_length=256)]


class RegisterNs(Msg, frozen=True):
    """A namespace this host uses: its digest and the descriptive fields, never the salt."""
    digest: Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
    model: Label
    dtype: Annotated[str, msgspec.Meta(max_length=64)]
    layout: Annotated[str, msgspec.Meta(max_length=64)]
    page_size: Small
    tp_rank: Small = 0
    tp_size: Small = 1
    pp_rank: Small = 0
    pp_size: Small = 1
    mla: bool = False
    salted: bool = False
    extra: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    pool: Annotated[str, msgspec.Meta(max_length=64)] = ""   # a v2 sidecar pool ("" = KV pages)


class Metadata(Msg, frozen=True):
    nixl_md: bytes


class Prove(Msg, frozen=True):
    """The nonces this host's NIXL agent received under the connection's proof tag, and where
    in its registered memory it wrote `Channel.proof` of each (`PROOF_MAC_BYTES` apart)."""
    nonces: Annotated[list[Annotated[bytes, msgspec.Meta(min_length=PROOF_NONCE_BYTES,
                                                         max_length=PROOF_NONCE_BYTES)]],
                      msgspec.Meta(min_length=1, max_length=MAX_PROOF_NONCES)]
    addr: Annotated[int, msgspec.Meta(ge=0)]


I64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]   # an SGLang block hash
Page = tuple[Key, I64, I64 | None]       # (block key, block hash, parent hash or None)
Pages = Annotated[list[Page], msgspec.Meta(max_length=MAX_KEYS)]
Cursor = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
NsDigest = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]


class Announce(Msg, frozen=True):
    """ANNOUNCE (version 6): pages this host stored, for the announcement feed of their
    namespace (`offload.agent.feed`). Reply `Flags`: per page, recorded (its namespace the
    host's, and the block durable in the agent's store)."""
    pages: Pages


class FeedRead(Msg, frozen=True):
    """FEED (version 6): the pages of namespace `ns` announced after `after`, at most `limit`."""
    ns: NsDigest
    after: Cursor = 0
    limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_KEYS)] = MAX_KEYS


class FeedPage(Msg, frozen=True):
    """A FEED reply: `pages` oldest first, `next` the cursor to read on from, `first` the
    oldest sequence the feed keeps (0: none; a cursor below `first - 1` missed pages), `epoch`
    the agent's (a new one: the agent restarted, its sequences restarted)."""
    epoch: Annotated[bytes, msgspec.Meta(max_length=16)]
    pages: Pages
    next: Cursor
    first: Cursor


class ErrorReply(Msg, frozen=True):
    message: str


REQUEST_TYPES: dict[int, Type[Msg]] = {
    HELLO: Hello, PUT: Blocks, GET: Blocks, EXISTS: KeyList, DELETE: KeyList, STATS: Empty,
    REGISTER_NS: RegisterNs, METADATA: Metadata, PROVE: Prove, DURABLE: Durable,
    ANNOUNCE: Announce, FEED: FeedRead,
}
REPLY_TYPES: dict[int, Type[Msg]] = {
    HELLO: HelloReply, PUT: Flags, GET: Flags, EXISTS: Flags, DELETE: Count, STATS: StatsReply,
    REGISTER_NS: Empty, METADATA: Empty, PROVE: Empty, DURABLE: Flags, ANNOUNCE: Flags,
    FEED: FeedPage, ERROR: ErrorReply,
}
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {t: msgspec.msgpack.Decoder(t) for t in set(REQUEST_TYPES.values()) |
             set(REPLY_TYPES.values())}
M = TypeVar("M", bound=Msg)


def _decoder(typ: Type[M]) -> msgspec.msgpack.Decoder[M]:
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
            return _decoder(typ).decode(self.meta)
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
            _settimeout(self.sock, deadline)
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


MAX_ERROR_CHARS = 4096             # of an ERROR reply's message (the agent cuts it there)
_REPLY_BASE = 256                  # a reply's header, META_LEN and msgpack framing, at most
_STATS_BOUND = 64 << 10            # a STATS reply (counters; no keys)
_PAGE_BOUND = 64                   # one FEED page: a 32-byte key and two i64, msgpack'd


ERROR_REPLY_BOUND = _REPLY_BASE + 4 * MAX_ERROR_CHARS   # an ErrorReply's body, at most


DECODED_PER_META_BYTE = 24        # Python bytes a msgpack byte of a request decodes to, at most
                                   # (a descriptor `(0, 1)`: 3 bytes, a 64-byte tuple in its list)
XFER_BYTES_PER_DESC = 512          # a descriptor's share of its transfer's lists (local and
                                   # remote, Python and NIXL: 256 measured; pieces may split it)


def decoded_bound(op: int, meta_len: int) -> int:
    """The most bytes decoding a request of `op` whose msgpack meta is `meta_len` bytes
    allocates: what the agent charges to the sender's key before it decodes
    (`Session._dispatch`). METADATA is one bytes field: its own size."""
    if op == METADATA:
        return meta_len + _REPLY_BASE
    return DECODED_PER_META_BYTE * meta_len


def work_bound(msg: Msg) -> int:
    """The most bytes serving decoded request `msg` allocates beside its reply: the descriptor
    lists of its NIXL transfers (`XFER_BYTES_PER_DESC` each)."""
    if isinstance(msg, Blocks) and msg.descs is not None:
        return XFER_BYTES_PER_DESC * sum(len(d) for d in msg.descs)
    if isinstance(msg, Prove):
        return XFER_BYTES_PER_DESC
    return 0


def reply_bound(op: int, msg: Msg) -> int:
    """The most bytes the body of the reply to request `msg` (of `op`) can take, an ERROR
    reply included: what the agent charges to the sender's key before serving it (an inline
    GET's payload: the sum of its sizes)."""
    bound = 4 * MAX_ERROR_CHARS                            # an ErrorReply (UTF-8), a HelloReply
    if isinstance(msg, Blocks):
        bound = max(bound, 10 * len(msg.keys))             # a bool and a u64 checksum per key
        if op == GET and msg.descs is None:
            bound += sum(msg.sizes)
    elif isinstance(msg, (KeyList, Durable)):
        bound = max(bound, len(msg.keys))
    elif isinstance(msg, Announce):
        bound = max(bound, len(msg.pages))
    elif isinstance(msg, FeedRead):
        bound = max(bound, _PAGE_BOUND * msg.limit + 64)
    elif isinstance(msg, Empty) and op == STATS:
        bound = max(bound, _STATS_BOUND)
    return _REPLY_BASE + bound


def _settimeout(sock: socket.socket, deadline: float) -> None:
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
        _settimeout(sock, deadline)
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
        _settimeout(sock, deadline)
        r = sock.recv_into(view[got:])
        if r == 0:
            raise ProtocolError(f"connection closed after {got} of {view.nbytes} bytes")
        got += r


def _derive(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, LABEL + server_nonce + client_nonce, hashlib.sha256).digest()


def _read_hello(sock: socket.socket, deadline: float) -> bytes:
    buf = bytearray(HANDSHAKE.size)
    _settimeout(sock, deadline)
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
    _settimeout(sock, deadline)
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
        claimed = _decoder(Hello).decode(view[META_LEN.size:META_LEN.size + meta_len])
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


def pack(idx: Sequence[int], sizes: Sequence[int], max_bytes: int,
         max_keys: int | None = None, counts: Sequence[int] | None = None,
         max_count: int = MAX_DESCS_PER_REQUEST) -> list[list[int]]:
    """Indices in order, cut into groups of at most `max_bytes` (and `max_keys`, and `max_count`
    summed over `counts`, e.g. descriptors per block); a block larger than `max_bytes` gets a
    group of its own. Requests (client) and staging groups (agent)."""
    out: list[list[int]] = []
    cur: list[int] = []
    used = n = 0
    for i in idx:
        c = counts[i] if counts is not None else 0
        if cur and (used + sizes[i] > max_bytes or (max_keys is not None and len(cur) >= max_keys)
                    or n + c > max_count):
            out.append(cur)
            cur, used, n = [], 0, 0
        cur.append(i)
        used += sizes[i]
        n += c
    if cur:
        out.append(cur)
    return out
