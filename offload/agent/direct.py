"""Zero-copy moves for a store with an arena (the DRAM tier): NIXL moves blocks straight between
host memory and the store's slots, with no staging copy.

Primitives: `Direct(store, arena, agent, quarantine, count, pool)`: what the moves need, handed in
by the server (`AgentServer.direct()`). `direct_put(direct, peer, req, todo, ok, deadline, owner,
allow)` NIXL READs
a PUT's blocks into slots from `reserve_slots`, then `commit_slots` (the store checksums each
block; a block whose bytes lack the checksum the host sent, `Blocks.sums`, is aborted instead) /
`abort_slots`; `direct_get(..., out_sums)` WRITEs a GET's blocks from slots held by `pin_slots`
(the store verifies each block's checksum first; `out_sums[i]` gets it, for the host to check),
then `unpin_slots`. Blocks are posted to NIXL in
chunks of about `CHUNK_BYTES`, and the store checksums (put: after its READ completed) or verifies
(get: before its WRITE is posted) one chunk on the mover's checksum pool while this thread moves
another (with UCX over TCP, posting a transfer copies its bytes in this thread). Each
returns the blocks it left to the staging path, sets `ok[i]`, and never raises. A transfer still
running at its deadline keeps its slots reserved / pinned in the mover's `Quarantine` until NIXL
says it is final: no slot is reused while a late transfer could still land in it or read it.
At most `allow` bytes of a request go this way (what the quarantine's bound leaves its `owner`,
`Quarantine.claim`); the rest takes the staging path, whose memory is bounded per connection.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from offload.agent import nixl_util, sums
from offload.agent.mover import Arena
from offload.agent.quarantine import Quarantine
from offload.store.base import SlotStore

if TYPE_CHECKING:
    from offload.agent.protocol import Blocks
    from offload.store.base import Slot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Direct:
    """What the zero-copy moves need, handed in by the server: the store's slot API, its arena
    registered with NIXL, the NIXL agent, its quarantine, and the server's counter and log
    (`warn(kind, tenant, msg, *args)`, rate-limited per kind and host key)."""
    store: SlotStore
    arena: Arena
    agent: Any
    quarantine: Quarantine
    count: Callable[[str, int], None]
    pool: Executor | None = None    # where the store's checksums run (`_later`)
    warn: Callable[..., None] | None = None


def _descs(arena: Arena, req: "Blocks", i: int, s: "Slot | None"
           ) -> tuple[list, list] | None:
    """(local, remote) descriptors moving block i to/from slot `s`, if NIXL reaches the slot
    (inside the registered arena); None for the staging path."""
    if s is None or s.view is None:
        return None
    addr, n = nixl_util.region_of(s.view)
    if n != req.sizes[i] or not arena.covers(addr, n):
        return None
    local, remote = [], []
    for raddr, rn in req.descs[i]:       # type: ignore[index]
        for la, ra, k in arena.pieces(addr, raddr, rn):
            local.append((la, k))
            remote.append((ra, k))
        addr += rn
    return local, remote


CHUNK_BYTES = 4 << 20      # blocks per NIXL transfer: the store checksums one chunk while NIXL
                           # moves the next
AHEAD = 2                  # chunks of a PUT posted beyond the one being waited on


class _Chunks:
    """A request's direct blocks in chunks of about `CHUNK_BYTES`, posted to NIXL (`post`, or
    `wait(ahead)` keeping `ahead` chunks posted beyond the one it waits on) and waited on in
    order."""

    def __init__(self, d: Direct, op: str, peer: str, deadline: float, owner: str):
        self.d, self.op, self.peer, self.deadline, self.owner = d, op, peer, deadline, owner
        self.chunks: list[tuple[list[int], list["Slot"], list, list]] = []   # closed chunks
        self.handles: list[Any] = []          # of the chunks posted so far (None: not posted)
        self._cur: tuple[list[int], list["Slot"], list, list] = ([], [], [], [])
        self._bytes = 0

    def add(self, i: int, slot: "Slot", local: list, remote: list) -> None:
        idx, slots, loc, rem = self._cur
        idx.append(i)
        slots.append(slot)
        loc += local
        rem += remote
        self._bytes += slot.length
        if self._bytes >= CHUNK_BYTES:
            self.close()

    def close(self) -> None:
        """End the current chunk (the next block starts a new one)."""
        if self._cur[0]:
            self.chunks.append(self._cur)
        self._cur, self._bytes = ([], [], [], []), 0

    def post(self, upto: int | None = None) -> None:
        """Post the closed chunks not posted yet, up to chunk `upto` (excluded)."""
        upto = len(self.chunks) if upto is None else min(upto, len(self.chunks))
        while len(self.handles) < upto:
            _, _, loc, rem = self.chunks[len(self.handles)]
            handle = None
            if time.monotonic() < self.deadline:
                try:
                    handle = nixl_util.start_xfer(self.d.agent, self.op, loc, rem, self.peer)
                except Exception as e:  # noqa: BLE001 - the data path reports failure, never raises
                    nixl_util.warn_peer("post", self.peer, "nixl %s with %s failed: %s", self.op,
                                        self.peer, e)
            self.handles.append(handle)

    def wait(self, release: Callable[[list["Slot"]], None], ahead: int | None = None
             ) -> Iterator[tuple[list[int], list["Slot"]]]:
        """Each chunk that completed, in order; the others' slots go to `release` (now, or once
        a transfer that outlived the deadline is final: quarantined). Chunks not posted yet are
        posted as it goes, `ahead` beyond the one waited on (all at once if None)."""
        self.close()
        for k, (idx, slots, _, _) in enumerate(self.chunks):
            self.post(None if ahead is None else k + 1 + ahead)
            handle = self.handles[k]
            pending: list[Any] = []
            good = handle is not None and nixl_util.wait_xfer(
                self.d.agent, handle, self.deadline, on_pending=pending.append, peer=self.peer)
            if good:
                yield idx, slots
            elif pending:
                self.d.quarantine.hold(pending[0], self.peer, len(slots),
                                       lambda s=slots: release(s),     # type: ignore[misc]
                                       owner=self.owner, nbytes=sum(s.length for s in slots))
                self.d.count("blocks_quarantined", len(slots))
            else:            # not posted, or ended in error: these blocks are misses
                self.d.count("blocks_nixl_failed", len(slots))
                release(slots)


def _later(d: Direct, fn: Callable[..., Any], *args: Any) -> "Future[Any]":
    """`fn(*args)` on the checksum pool (inline without one): the store's checksums of one chunk
    run there while this thread moves the next chunk (with UCX over TCP the mover's own thread
    copies the bytes: done in turn, the two would add up)."""
    if d.pool is not None:
        return d.pool.submit(fn, *args)
    fut: "Future[Any]" = Future()
    fut.set_result(fn(*args))
    return fut


def _by_bytes(idx: list[int], sizes: list[int], limit: int) -> list[list[int]]:
    """`idx` cut in runs of about `limit` bytes (a run ends once it reaches `limit`)."""
    out: list[list[int]] = [[]]
    total = 0
    for i in idx:
        out[-1].append(i)
        total += sizes[i]
        if total >= limit:
            out.append([])
            total = 0
    return [g for g in out if g]


def _within(req: "Blocks", idx: list[int], allow: int) -> tuple[list[int], list[int]]:
    """(the first blocks of `idx` whose sizes add up to at most `allow`, the others)."""
    n, total = 0, 0
    while n < len(idx) and total + req.sizes[idx[n]] <= allow:
        total += req.sizes[idx[n]]
        n += 1
    return idx[:n], idx[n:]


def direct_put(d: Direct | None, peer: str | None, req: "Blocks", todo: list[int],
               ok: list[bool | None], deadline: float, owner: str = "", allow: int = 1 << 62
               ) -> list[int]:
    """NIXL READs blocks straight into reserved store slots; returns the blocks left for the
    staging path (the store has no arena, or gave no slot, or past `allow` bytes). Each chunk is
    committed (the store checksums it) while NIXL still reads the next ones."""
    if not todo or peer is None or d is None:
        return todo
    store = d.store
    d.quarantine.reap()
    todo, rest = _within(req, todo, allow)
    slots = store.reserve_slots([req.keys[i] for i in todo], [req.sizes[i] for i in todo])
    chunks, unused = _Chunks(d, "READ", peer, deadline, owner), []
    for i, s in zip(todo, slots):
        descs = _descs(d.arena, req, i, s)
        if descs is None:
            rest.append(i)
            if s is not None:
                unused.append(s)
        else:
            chunks.add(i, s, *descs)      # type: ignore[arg-type]
    if unused:
        store.abort_slots(unused)
    commits = [(idx, done, _later(d, _check_commit, d, req, idx, done, owner))
               for idx, done in chunks.wait(store.abort_slots, AHEAD)]
    for idx, done, fut in commits:
        for i, f in zip(idx, fut.result()):
            ok[i] = f
        d.count("bytes_nixl_in", sum(s.length for s in done))
        d.count("blocks_direct_in", len(done))
    return rest


def _check_commit(d: Direct, req: "Blocks", idx: list[int], slots: list["Slot"], owner: str
                  ) -> list[bool]:
    """Commit the slots a READ filled whose bytes have the checksum the host sent with the PUT
    (`offload.agent.sums`); the others are aborted (a miss, counted). On the checksum pool."""
    if req.sums is None:
        return d.store.commit_slots(slots)
    good = [sums.of_views([s.view]) == req.sums[i] for i, s in zip(idx, slots)]
    bad = [s for s, g in zip(slots, good) if not g]
    if bad:
        d.store.abort_slots(bad)
        d.count("checksum_mismatch_in", len(bad))
        if d.warn is not None:
            d.warn("checksum-in", owner, "%d block(s) read from host key %s do not have the "
                   "checksum it sent: not stored", len(bad), owner)
    flags = iter(d.store.commit_slots([s for s, g in zip(slots, good) if g]))
    return [g and next(flags) for g in good]


def _pin_sums(store: SlotStore, keys: list[bytes]) -> tuple[list["Slot | None"], list[int]]:
    """`pin_slots`, and the checksum of each pinned block (sent with the GET reply)."""
    slots = store.pin_slots(keys)
    return slots, [sums.of_views([s.view]) if s is not None and s.view is not None else 0
                   for s in slots]


def direct_get(d: Direct | None, peer: str | None, req: "Blocks", ok: list[bool],
               deadline: float, owner: str = "", allow: int = 1 << 62,
               out_sums: list[int] | None = None) -> list[int]:
    """NIXL WRITEs stored blocks straight from their pinned slots; returns the blocks left for
    the staging path (past `allow` bytes too). Blocks are pinned (the store verifies their
    checksums) a chunk at a time on the checksum pool, up to two chunks ahead of the one NIXL
    writes; a chunk is posted only once pinned and verified."""
    if peer is None or d is None:
        return list(range(len(req.keys)))
    store = d.store
    d.quarantine.reap()
    todo, rest = _within(req, list(range(len(req.keys))), allow)
    chunks = _Chunks(d, "WRITE", peer, deadline, owner)
    groups = _by_bytes(todo, req.sizes, CHUNK_BYTES)
    pins = [_later(d, _pin_sums, store, [req.keys[i] for i in g]) for g in groups[:2]]
    for g, group in enumerate(groups):
        slots, got = pins[g].result()  # pinned and verified while NIXL wrote the chunks before
        if g + 2 < len(groups):
            pins.append(_later(d, _pin_sums, store, [req.keys[i] for i in groups[g + 2]]))
        if out_sums is not None:
            for i, c in zip(group, got):
                out_sums[i] = c
        for i, s in zip(group, slots):
            descs = _descs(d.arena, req, i, s)
            if descs is None:
                rest.append(i)
                if s is not None:
                    store.unpin_slots([s], [False])
            else:
                chunks.add(i, s, *descs)      # type: ignore[arg-type]
        chunks.close()
        chunks.post()

    def failed(slots: list["Slot"]) -> None:
        store.unpin_slots(slots, [False] * len(slots))

    for idx, done in chunks.wait(failed):
        store.unpin_slots(done, [True] * len(done))
        for i in idx:
            ok[i] = True
        d.count("bytes_nixl_out", sum(s.length for s in done))
        d.count("blocks_direct_out", len(done))
    return rest
