"""A connection's PUT and GET of blocks on the agent (data path of `Session`).

Primitives: `PutGet(session)`, a part of its `Session`; `check(req)` enforces a request's bounds
(sizes, at most `MAX_DESCS_PER_REQUEST` descriptors, lengths adding up) and, with descriptors,
that they lie in the memory the connection's proven endpoint registered (`Endpoint.peer`,
`Mover.covers`) and that the host key's quarantine has room; `put(req, payload, settle)` /
`get(req)` move the blocks: inline on the connection, else by NIXL straight into or from the
store's slots (`offload.agent.direct`, within what `Quarantine.claim` allows) and the rest
through the connection's staging memory (`StagedPath`). A GET of a block put but not yet
durable (`ctx.acks`) waits for it at most `GET_WAIT_S` or its budget (the one place), then misses.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import msgspec

from offload.agent import protocol
from offload.agent.acks import GET_WAIT_S, Settle
from offload.agent.direct import direct_get, direct_put
from offload.agent.refused import RequestError

if TYPE_CHECKING:
    from offload.agent.session import Session


class PutGet:
    def __init__(self, session: "Session"):
        self._s = session

    def check(self, req: protocol.Blocks) -> str | None:
        """Bounds of a PUT / GET; with descriptors, the connection's proven NIXL peer, whose
        registered memory they must lie in. Raises RequestError."""
        self._lengths(req)
        for size in req.sizes:
            if size > self._s.ctx.limits.max_block:
                raise RequestError(f"block of {size} bytes exceeds the agent's limit "
                                   f"{self._s.ctx.limits.max_block}")
        if req.descs is not None:
            total = sum(len(d) for d in req.descs)
            if total > protocol.MAX_DESCS_PER_REQUEST:
                raise RequestError(f"{total} descriptors in one request; the limit is "
                                   f"{protocol.MAX_DESCS_PER_REQUEST}")
            for size, descs in zip(req.sizes, req.descs):
                if sum(d[1] for d in descs) != size:
                    raise RequestError("descriptor lengths do not add up to the block size")
            peer = self._s.endpoint.peer()
            if peer is None:
                raise RequestError("descriptors sent but this connection does not use NIXL "
                                   "(no NIXL metadata, or its endpoint is not proven: PROVE)")
            assert self._s.ctx.mover is not None
            if not self._s.ctx.mover.covers(peer, [d for ds in req.descs for d in ds]):
                raise RequestError(f"descriptors outside the memory NIXL agent {peer} "
                                   "registered")
            self._s.endpoint.quarantine_room(self._s.ctx.mover)
            return peer
        return None

    @staticmethod
    def _lengths(req: protocol.Blocks) -> None:
        """As many sizes (and descriptor lists) as keys. Raises RequestError."""
        n = len(req.keys)
        if len(req.sizes) != n or (req.descs is not None and len(req.descs) != n):
            raise RequestError(f"{n} keys but {len(req.sizes)} sizes / "
                               f"{len(req.descs or [])} descriptor lists")

    def put(self, req: protocol.Blocks, payload: memoryview, settle: Settle | None
             ) -> Sequence[bool | None]:
        """Per block, written (durable later for the disk store: `ctx.acks`), or None: received
        in staging, its store write reports to `settle` (`StagedPath.put`)."""
        peer = self.check(req)
        store = self._s.ctx.store
        if req.descs is None:
            if sum(req.sizes) != payload.nbytes:
                raise RequestError(f"payload of {payload.nbytes} bytes, sizes add up to "
                                   f"{sum(req.sizes)}")
            blocks, off = [], 0
            for size in req.sizes:
                blocks.append([payload[off:off + size]])
                off += size
            self._s.ctx.count("bytes_inline_in", payload.nbytes)
            return store.put_many(req.keys, blocks)
        assert peer is not None and self._s.ctx.mover is not None
        deadline = time.monotonic() + req.budget_ms / 1000.0
        present = store.exists_many(req.keys)
        ok: list[bool | None] = list(present)
        todo = [i for i, p in enumerate(present) if not p]
        q, owner = self._s.ctx.mover.quarantine, self._s.staged.owner
        allow = q.claim(owner, sum(req.sizes[i] for i in todo), self._s.ctx.limits.max_quarantine)
        try:
            todo = direct_put(self._s.ctx.direct(), peer, req, todo, ok, deadline, owner, allow)
        finally:
            q.unclaim(owner, allow)
        if not todo:
            return ok
        self._s.staged.put(req, todo, ok, peer, deadline, settle)
        return ok

    def get(self, req: protocol.Blocks
             ) -> tuple[list[bool], list[memoryview], list[int] | None]:
        """A block put but not yet durable (`ctx.acks`) is waited for, briefly, then a miss."""
        self._lengths(req)   # before the visible keys are picked out by index (`check` after)
        acks = self._s.ctx.acks
        hidden = acks.hidden(req.keys)
        if any(hidden):
            end = time.monotonic() + min(GET_WAIT_S, req.budget_ms / 1000.0)
            acks.wait([k for k, h in zip(req.keys, hidden) if h], end)
            hidden = acks.hidden(req.keys)
        if not any(hidden):
            return self._get_visible(req)
        idx = [i for i, h in enumerate(hidden) if not h]
        sub = msgspec.structs.replace(
            req, keys=[req.keys[i] for i in idx], sizes=[req.sizes[i] for i in idx],
            descs=None if req.descs is None else [req.descs[i] for i in idx])
        got, payload, sub_sums = self._get_visible(sub)
        flags = [False] * len(req.keys)
        out_sums = None if sub_sums is None else [0] * len(req.keys)
        for n, (i, f) in enumerate(zip(idx, got)):
            flags[i] = f
            if out_sums is not None and sub_sums is not None:
                out_sums[i] = sub_sums[n]
        return flags, payload, out_sums

    def _get_visible(self, req: protocol.Blocks
                     ) -> tuple[list[bool], list[memoryview], list[int] | None]:
        """(flags, inline payload, with descriptors each block's checksum for the host)."""
        peer = self.check(req)
        store = self._s.ctx.store
        if req.descs is None:
            total = sum(req.sizes)
            if total + 4096 > self._s.ctx.limits.max_body:
                raise RequestError(f"reply of {total} bytes would exceed the frame limit")
            buf = memoryview(bytearray(total))
            dests, off = [], 0
            for size in req.sizes:
                dests.append([buf[off:off + size]])
                off += size
            flags = store.get_many(req.keys, dests)
            out = [d[0] for d, f in zip(dests, flags) if f]
            self._s.ctx.count("bytes_inline_out", sum(v.nbytes for v in out))
            return flags, out, None
        assert peer is not None and self._s.ctx.mover is not None
        deadline = time.monotonic() + req.budget_ms / 1000.0
        ok = [False] * len(req.keys)
        got = [0] * len(req.keys)
        q, owner = self._s.ctx.mover.quarantine, self._s.staged.owner
        allow = q.claim(owner, sum(req.sizes), self._s.ctx.limits.max_quarantine)
        try:
            rest = direct_get(self._s.ctx.direct(), peer, req, ok, deadline, owner, allow, got)
        finally:
            q.unclaim(owner, allow)
        if rest:
            self._s.staged.get(req, rest, ok, peer, deadline, got)
        return ok, [], got
