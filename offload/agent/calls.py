"""The block calls of an `AgentStore` (data path, never raises): PUT and GET of blocks.

Primitives: `BlockCalls(use, host, connections, budget)` (`budget(deadline)`: a request's
budget in ms on the agent, `budget_ms` by default); `blocks(op, keys, bufs, deadline)` -> per
block, True when moved. Blocks whose buffers lie in memory registered with NIXL (`HostNixl`)
travel by NIXL, the agent READing / WRITEing them itself, in batches of at most
`NIXL_BATCH_BYTES`; the rest travel inline on the control connection. A PUT carries each block's
checksum, which the agent checks on what its READ landed.

A GET over NIXL never hands the agent the caller's pages (`_get_landed`, the one place a GET's
descriptors are built): the agent WRITEs into the host's landing area (`offload.agent.landing`),
and each block is copied into the caller's pages after a good reply, then checked there against
the checksum the agent sent (`_send_batch`; a mismatch is a miss, counted in `get_mismatch`). The
extent of a request given up on is held out of use (`Landing.hold`).
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any, Callable, ContextManager, Sequence

from offload.agent import protocol, sums
from offload.agent.conn import AgentConn, Down, Refused
from offload.agent.host_nixl import HostNixl
from offload.store.base import Buffer

NIXL_BATCH_BYTES = 256 << 20      # bytes moved by one NIXL request (bounded work per deadline)
Use = Callable[[float | None], ContextManager[tuple[AgentConn | None, float]]]


def budget_ms(deadline: float) -> int:
    """A request's budget on the agent: 80% of what is left of the call."""
    return max(1, int((deadline - time.monotonic()) * 800))


class BlockCalls:
    def __init__(self, use: Use, host: HostNixl, connections: int,
                 budget: Callable[[float], int] = budget_ms):
        self._use = use                   # a connection for one call, and the call's deadline
        self._budget = budget             # a request's budget on the agent (ms)
        self._host = host
        self._connections = connections
        self._lock = threading.Lock()
        self.get_mismatch = 0     # GET blocks whose bytes lacked the agent's checksum: misses

    def blocks(self, op: int, keys: Sequence[bytes], bufs: Sequence[Sequence[Buffer]],
                deadline: float | None = None) -> list[bool]:
        ok = [False] * len(keys)
        with self._use(deadline) as (c, deadline):
            if c is None:
                return ok
            try:
                info = c.connect(deadline)
            except Down:
                return ok
            sizes = [sum(_nbytes(b) for b in bs) for bs in bufs]
            nixl_idx: list[int] = []
            inline_idx: list[int] = []
            descs: dict[int, list[tuple[int, int]]] = {}
            for i, bs in enumerate(bufs):
                if len(keys[i]) != 32 or sizes[i] > info.max_block:
                    continue
                d = self._host.descs(bs) if c.nixl else None
                if d is not None and len(d) <= protocol.MAX_DESCS_PER_BLOCK:
                    descs[i] = d
                    nixl_idx.append(i)
                else:
                    inline_idx.append(i)
            counts = [len(descs.get(i, ())) for i in range(len(keys))]
            if op == protocol.GET:
                return self._get_landed(c, deadline, keys, bufs, sizes, nixl_idx, inline_idx,
                                        descs, info, ok)
            for batch in protocol.pack(nixl_idx, sizes, NIXL_BATCH_BYTES, info.max_keys, counts):
                # A PUT's checksums travel in the MAC'd frame; the agent checks its READ by them.
                req = protocol.Blocks(keys=[keys[i] for i in batch], sizes=[sizes[i] for i in batch],
                               descs=[descs[i] for i in batch], budget_ms=self._budget(deadline),
                               sums=[sums.of_regions(descs[i]) for i in batch])
                if not self._send_batch(c, deadline, op, req, batch, ok):
                    return ok
            self._inline(c, deadline, op, keys, bufs, sizes, inline_idx, info, ok)
        return ok

    def _inline(self, c: AgentConn, deadline: float, op: int, keys: Sequence[bytes],
                bufs: Sequence[Sequence[Buffer]], sizes: list[int], idx: list[int],
                info: protocol.HelloReply, ok: list[bool]) -> None:
        """Blocks `idx` with their bytes on the control connection (a GET's copied into the
        caller's buffers only from a good reply)."""
        room = info.max_body - (64 << 10)
        for batch in protocol.pack(idx, sizes, room, min(info.max_keys, room // 64)):
            req = protocol.Blocks(keys=[keys[i] for i in batch], sizes=[sizes[i] for i in batch],
                           budget_ms=self._budget(deadline))
            payload = None
            if op == protocol.PUT:
                payload = [memoryview(b).cast("B") for i in batch for b in bufs[i]]
            if not self._send_batch(c, deadline, op, req, batch, ok, payload, bufs):
                return

    def _get_landed(self, c: AgentConn, deadline: float, keys: Sequence[bytes],
                    bufs: Sequence[Sequence[Buffer]], sizes: list[int], nixl_idx: list[int],
                    inline_idx: list[int], descs: dict[int, list[tuple[int, int]]],
                    info: protocol.HelloReply, ok: list[bool]) -> list[bool]:
        """A GET: NIXL WRITEs into the landing area only (never into `bufs`), each block copied
        into its buffers after a good reply (`_send_batch`); blocks the area has no room for now
        travel inline. The extent of a request given up on is held (`Landing.hold`)."""
        landing = self._host.landing
        cap = NIXL_BATCH_BYTES if landing is None else min(
            NIXL_BATCH_BYTES, landing.size // self._connections)
        for batch in protocol.pack(nixl_idx, sizes, cap, info.max_keys):
            total = sum(sizes[i] for i in batch)
            base = landing.take(total) if landing is not None and total <= cap else None
            if landing is None or base is None:
                inline_idx.extend(batch)
                continue
            at, land = base, []
            for i in batch:
                land.append([(at, sizes[i])] if sizes[i] else [])
                at += sizes[i]
            req = protocol.Blocks(keys=[keys[i] for i in batch], sizes=[sizes[i] for i in batch],
                                  descs=land, budget_ms=self._budget(deadline))
            answered = False
            try:
                answered = self._send_batch(c, deadline, protocol.GET, req, batch, ok,
                                            landed=[descs[i] for i in batch])
            finally:
                (landing.give if answered else landing.hold)(base)
            if not answered:
                return ok
        self._inline(c, deadline, protocol.GET, keys, bufs, sizes, sorted(inline_idx), info, ok)
        return ok

    def _send_batch(self, c: AgentConn, deadline: float, op: int, req: protocol.Blocks,
                    batch: list[int], ok: list[bool], payload: list[memoryview] | None = None,
                    bufs: Sequence[Sequence[Buffer]] | None = None,
                    landed: list[list[tuple[int, int]]] | None = None) -> bool:
        """Send one batch, set `ok` from its reply; False if the agent did not answer (the
        connection was reset). With `landed` (a GET through the landing area: the caller's
        regions of each block), blocks are copied from `req.descs` into them, then checked."""
        try:
            reply, data = c.request(op, req, payload, deadline)
        except Refused:
            return True
        except Down:
            return False
        flags = list(reply.ok)  # type: ignore[attr-defined]
        if len(flags) != len(batch):
            c.fail(protocol.ProtocolError("reply flags do not match the request"))
            return False
        if op == protocol.GET and req.descs is None and bufs is not None:
            expect = sum(s for s, f in zip(req.sizes, flags) if f)
            if data.nbytes != expect:
                c.fail(protocol.ProtocolError(f"reply payload {data.nbytes} bytes, expected {expect}"))
                return False
            off = 0
            for i, f in zip(batch, flags):
                if f:
                    for b in bufs[i]:
                        mv = memoryview(b).cast("B")
                        mv[:] = data[off:off + mv.nbytes]
                        off += mv.nbytes
        got = getattr(reply, "sums", None)
        if op == protocol.GET and req.descs is not None:
            # Copied into the caller's pages by this host, then checked there: what NIXL wrote
            # must have the checksum the agent sent beside it (and a late WRITE of an earlier
            # request into a reused landing extent fails it too).
            for k, f in enumerate(flags):
                if not f:
                    continue
                dst = landed[k] if landed is not None else req.descs[k]
                if landed is not None:
                    _copy(req.descs[k], dst)
                if got is None or len(got) != len(flags) or sums.of_regions(dst) != got[k]:
                    flags[k] = False
                    with self._lock:
                        self.get_mismatch += 1
        for i, f in zip(batch, flags):
            ok[i] = bool(f)
        return True


def _copy(src: Sequence[tuple[int, int]], dst: Sequence[tuple[int, int]]) -> None:
    """Copy the bytes at regions `src` (this process's memory) into regions `dst`, in order;
    both add up to the same length (one block)."""
    si, soff = 0, 0
    for daddr, dn in dst:
        while dn:
            saddr, sn = src[si]
            k = min(dn, sn - soff)
            ctypes.memmove(daddr, saddr + soff, k)
            daddr, dn, soff = daddr + k, dn - k, soff + k
            if soff == sn:
                si, soff = si + 1, 0


def _nbytes(buf: Any) -> int:
    """Bytes of one block buffer: a torch tensor (`data_ptr`) or anything with the buffer protocol."""
    if hasattr(buf, "data_ptr"):
        return int(buf.numel() * buf.element_size())
    return memoryview(buf).nbytes

