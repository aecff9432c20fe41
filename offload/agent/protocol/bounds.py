"""The bounds of what serving one request allocates, charged to the sender's key before it is
decoded and served (`decoded_bound`, `work_bound`, `reply_bound`: `Session._dispatch` takes them
from `budget.Memory`), and `pack`, which cuts a request's blocks
into groups within the frame limits.
"""

from __future__ import annotations

from typing import Sequence

from offload.agent.protocol.messages import (
    GET,
    MAX_DESCS_PER_REQUEST,
    METADATA,
    STATS,
    Announce,
    Blocks,
    Durable,
    Empty,
    FeedRead,
    KeyList,
    Msg,
    Prove,
)

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
