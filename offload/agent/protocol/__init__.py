"""The agent's control protocol: a handshake, then authenticated, size-bounded, versioned frames.

A package, one role per module, every name re-exported here (`protocol.X`): `messages` (the
wire's constants, ops, errors and message types, whose annotations bound keys, descriptors and
nonces), `frames` (the codec and `Channel`: MAC, sequence, `read_frame` with its size checks),
`handshake` (the key derivation, `accept_hello`), `bounds` (what serving a request may allocate,
charged before it is decoded; `pack`).

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

from offload.agent.protocol.bounds import (
    DECODED_PER_META_BYTE,
    ERROR_REPLY_BOUND,
    MAX_ERROR_CHARS,
    XFER_BYTES_PER_DESC,
    decoded_bound,
    pack,
    reply_bound,
    work_bound,
)
from offload.agent.protocol.frames import (
    Channel,
    Frame,
    read_frame,
    recv_exact_into,
    send_parts,
)
from offload.agent.protocol.handshake import (
    accept_hello,
    handshake_client,
    handshake_server,
)
from offload.agent.protocol.messages import (
    ANNOUNCE,
    DEFAULT_MAX_BODY,
    DELETE,
    DURABLE,
    ERROR,
    EXISTS,
    FEED,
    FRAME_MAGIC,
    GET,
    HANDSHAKE,
    HANDSHAKE_MAGIC,
    HEADER,
    HELLO,
    HOST_PATTERN,
    I64,
    LABEL,
    MAC_BYTES,
    MAX_DESCS_PER_BLOCK,
    MAX_DESCS_PER_REQUEST,
    MAX_KEYS,
    MAX_META_BYTES,
    MAX_PROOF_NONCES,
    META_LEN,
    METADATA,
    NONCE_BYTES,
    OP_NAMES,
    PRE_AUTH_MAX_BODY,
    PROOF_LABEL,
    PROOF_MAC_BYTES,
    PROOF_MAGIC,
    PROOF_NONCE_BYTES,
    PROOF_TAG_BYTES,
    PROVE,
    PUT,
    REGISTER_NS,
    REPLY,
    REPLY_TYPES,
    REQUEST_TYPES,
    STATS,
    VERSION,
    Announce,
    AuthError,
    BlockDescs,
    Blocks,
    Budget,
    Count,
    Cursor,
    Desc,
    Durable,
    Empty,
    ErrorReply,
    FeedPage,
    FeedRead,
    Flags,
    Hello,
    HelloReply,
    HostName,
    Key,
    KeyList,
    Keys,
    Label,
    Metadata,
    Msg,
    NsDigest,
    Page,
    Pages,
    ProtocolError,
    Prove,
    RegisterNs,
    Size,
    Small,
    StatsReply,
    Sum,
)

__all__ = [
    "ANNOUNCE", "Announce", "AuthError", "BlockDescs", "Blocks", "Budget", "Channel", "Count",
    "Cursor", "DECODED_PER_META_BYTE", "DEFAULT_MAX_BODY", "DELETE", "DURABLE", "Desc", "Durable",
    "ERROR", "ERROR_REPLY_BOUND", "EXISTS", "Empty", "ErrorReply", "FEED", "FRAME_MAGIC",
    "FeedPage", "FeedRead", "Flags", "Frame", "GET", "HANDSHAKE", "HANDSHAKE_MAGIC", "HEADER",
    "HELLO", "HOST_PATTERN", "Hello", "HelloReply", "HostName", "I64", "Key", "KeyList", "Keys",
    "LABEL", "Label", "MAC_BYTES", "MAX_DESCS_PER_BLOCK", "MAX_DESCS_PER_REQUEST",
    "MAX_ERROR_CHARS", "MAX_KEYS", "MAX_META_BYTES", "MAX_PROOF_NONCES", "METADATA", "META_LEN",
    "Metadata", "Msg", "NONCE_BYTES", "NsDigest", "OP_NAMES", "PRE_AUTH_MAX_BODY", "PROOF_LABEL",
    "PROOF_MAC_BYTES", "PROOF_MAGIC", "PROOF_NONCE_BYTES", "PROOF_TAG_BYTES", "PROVE", "PUT",
    "Page", "Pages", "ProtocolError", "Prove", "REGISTER_NS", "REPLY", "REPLY_TYPES",
    "REQUEST_TYPES", "RegisterNs", "STATS", "Size", "Small", "StatsReply", "Sum", "VERSION",
    "XFER_BYTES_PER_DESC", "accept_hello", "decoded_bound", "handshake_client", "handshake_server",
    "pack", "read_frame", "recv_exact_into", "reply_bound", "send_parts", "work_bound",
]
