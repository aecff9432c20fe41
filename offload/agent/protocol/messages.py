"""The wire of the agent's protocol: its constants (version, magics, header layouts, the size
limits a frame is checked against), the ops, the errors, and every message type (msgspec Structs
whose annotations bound what a request can name: `MAX_KEYS` keys, `MAX_DESCS_PER_BLOCK`
descriptors a block, `MAX_PROOF_NONCES` nonces a PROVE); `REQUEST_TYPES` / `REPLY_TYPES` map an
op to its type.
"""

from __future__ import annotations

import struct
from typing import Annotated, Type

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
