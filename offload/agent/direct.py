"""Zero-copy moves for a store with an arena (the DRAM tier): NIXL moves blocks straight between
host memory and the store's slots, with no staging copy.

Primitives: `Direct(store, arena, agent, quarantine, count)`: what the moves need, handed in by
the server (`AgentServer.direct()`). `direct_put(direct, peer, req, todo, ok, deadline, owner,
allow)` NIXL READs
a PUT's blocks into slots from `reserve_slots`, then `commit_slots` (the store checksums each
block) / `abort_slots`; `direct_get(...)` WRITEs a GET's blocks from slots held by `pin_slots` (the
store verifies each block's checksum first), then `unpin_slots`. Blocks are posted to NIXL in
chunks of about `CHUNK_BYTES`, so the store checksums one chunk while NIXL moves the next. Each
returns the blocks it left to the staging path, sets `ok[i]`, and never raises. A transfer still
running at its deadline keeps its slots reserved / pinned in the mover's `Quarantine` until NIXL
says it is final: no slot is reused while a late transfer could still land in it or read it.
At most `allow` bytes of a request go this way (what the quarantine's bound leaves its `owner`,
`Quarantine.claim`); the rest takes the staging path, whose memory is bounded per connection.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from offload.agent import nixl_util
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
    registered with NIXL, the NIXL agent, its quarantine, and the server's counter."""
    store: SlotStore
    arena: Arena
    agent: Any
    quarantine: Quarantine
    count: Callable[[str, int], None]


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


CHUNK_BYTES = 4 << 20      # blocks posted per NIXL transfer: the store checksums one chunk while
                           # NIXL moves the next


class _Chunks:
    """A request's direct blocks, posted to NIXL a chunk at a time, each waited on in order."""

    def __init__(self, d: Direct, op: str, peer: str, deadline: float, owner: str):
        self.d, self.op, self.peer, self.deadline, self.owner = d, op, peer, deadline, owner
        self.posted: list[tuple[list[int], list["Slot"], Any]] = []
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
            self.post()

    def post(self) -> None:
        idx, slots, loc, rem = self._cur
        if not idx:
            return
        self._cur, self._bytes = ([], [], [], []), 0
        handle = None
        if time.monotonic() < self.deadline:
            try:
                handle = nixl_util.start_xfer(self.d.agent, self.op, loc, rem, self.peer)
            except Exception as e:  # noqa: BLE001 - the data path reports failure, never raises
                log.warning("nixl %s with %s failed: %s", self.op, self.peer, e)
        self.posted.append((idx, slots, handle))

    def wait(self, release: Callable[[list["Slot"]], None]
             ) -> Iterator[tuple[list[int], list["Slot"]]]:
        """Each chunk that completed, in order; the others' slots go to `release` (now, or once
        a transfer that outlived the deadline is final: quarantined)."""
        self.post()
        for idx, slots, handle in self.posted:
            pending: list[Any] = []
            good = handle is not None and nixl_util.wait_xfer(
                self.d.agent, handle, self.deadline, on_pending=pending.append)
            if good:
                yield idx, slots
            elif pending:
                self.d.quarantine.hold(pending[0], self.peer, len(slots),
                                       lambda s=slots: release(s),     # type: ignore[misc]
                                       owner=self.owner, nbytes=sum(s.length for s in slots))
                self.d.count("blocks_quarantined", len(slots))
            else:
                release(slots)


def _within(req: "Blocks", idx: list[int], allow: int) -> tuple[list[int], list[int]]:
    """(the first blocks of `idx` whose sizes add up to at most `allow`, the others)."""
    n, total = 0, 0
    while n < len(idx) and total + req.sizes[idx[n]] <= allow:
        total += req.sizes[idx[n]]
        n += 1
    return idx[:n], idx[n:]


def direct_put(d: Direct | None, peer: str | None, req: "Blocks", todo: list[int],
               ok: list[bool], deadline: float, owner: str = "", allow: int = 1 << 62
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
    for idx, done in chunks.wait(store.abort_slots):
        for i, f in zip(idx, store.commit_slots(done)):
            ok[i] = f
        d.count("bytes_nixl_in", sum(s.length for s in done))
        d.count("blocks_direct_in", len(done))
    return rest


def direct_get(d: Direct | None, peer: str | None, req: "Blocks", ok: list[bool],
               deadline: float, owner: str = "", allow: int = 1 << 62) -> list[int]:
    """NIXL WRITEs stored blocks straight from their pinned slots; returns the blocks left for
    the staging path (past `allow` bytes too). Blocks are pinned (the store verifies their
    checksums) a chunk at a time, while NIXL writes the chunks before."""
    if peer is None or d is None:
        return list(range(len(req.keys)))
    store = d.store
    d.quarantine.reap()
    todo, rest = _within(req, list(range(len(req.keys))), allow)
    chunks = _Chunks(d, "WRITE", peer, deadline, owner)
    for i in todo:
        (s,) = store.pin_slots([req.keys[i]])
        descs = _descs(d.arena, req, i, s)
        if descs is None:
            rest.append(i)
            if s is not None:
                store.unpin_slots([s], [False])
        else:
            chunks.add(i, s, *descs)      # type: ignore[arg-type]

    def failed(slots: list["Slot"]) -> None:
        store.unpin_slots(slots, [False] * len(slots))

    for idx, done in chunks.wait(failed):
        store.unpin_slots(done, [True] * len(done))
        for i in idx:
            ok[i] = True
        d.count("bytes_nixl_out", sum(s.length for s in done))
        d.count("blocks_direct_out", len(done))
    return rest
