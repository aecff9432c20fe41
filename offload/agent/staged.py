"""The staging path of one connection: NIXL moves a request's blocks through staging memory while
the store reads or writes the other half.

Primitives: `StagedPath(ctx, conn_id)` (`offload.agent.context.AgentContext`); `.put(req, todo, ok,
peer, deadline, settle)` NIXL READs the `todo` blocks of a PUT from host memory into a staging half
while the store writes the previous half (one `put_many` per whole half: the store's cost is per
call). With `settle` the writes still running when the last READ completed are not waited for (their
blocks are set None and the write reports to `settle`, `offload.agent.acks`): they go on while the
next request's READ fills the other half (both halves' writes may run at once, on two store
threads), and a half is reused only once its write is done. `.get(req, todo, ok, peer, deadline)`
has the store read a half while NIXL WRITEs the previous one into host memory (a request that fits
one half is cut in two, so that the two overlap; a block is True only after its WRITE completed);
`.close()` (waits for the writes). Both set `ok[i]` and never raise.
A transfer still running at its deadline may yet land in, or read, its staging half: the whole
staging memory is then quarantined (`offload.agent.quarantine`) until NIXL says it is final, and
the next request gets fresh staging. Used by `offload.agent.session` for stores without an arena
(the disk store) and for the blocks the zero-copy moves (`offload.agent.direct`) left.
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Sequence

from offload.agent import nixl_util, protocol, sums
from offload.agent.acks import Settle

if TYPE_CHECKING:
    from offload.agent.context import AgentContext
    from offload.agent.mover import Mover, Staging

log = logging.getLogger("offload.agent")


class NoMemory(Exception):
    """Staging past the agent's memory bound (`offload.agent.budget`)."""


class StagedPath:
    def __init__(self, ctx: "AgentContext", conn_id: int):
        self.ctx = ctx
        self.conn_id = conn_id
        self.owner = ""            # the connection's tenant: whose quarantine bound it counts in
        self.staging: "Staging | None" = None
        self._pool: ThreadPoolExecutor | None = None
        self._writing: list[Future | None] = [None, None]   # store write reading each half
        self._half = 1                                       # the half a put used last
        self._taken: dict[int, int] = {}     # id(staging) -> bytes taken from ctx.memory

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)      # writes still reading staging finish first
            self._pool = None
        self._writing = [None, None]
        if self.staging is not None:
            self._close_staging(self.staging)
            self.staging = None

    def _mover(self) -> "Mover":
        assert self.ctx.mover is not None
        return self.ctx.mover

    def _staging(self) -> "Staging":
        """This connection's staging, mapped on first use within the agent's memory bound
        (`offload.agent.budget`; raises `NoMemory` past it)."""
        if self.staging is None:
            from offload.agent.mover import Staging

            size = self.ctx.limits.staging_size
            why = self.ctx.memory.take(self.owner, size)
            if why is not None:
                self.ctx.count("rejected_memory")
                self.ctx.warn("staging-memory", self.owner, "no staging for host key %s: %s", self.owner, why)
                raise NoMemory(why)
            try:
                staging = Staging(self._mover(), size)
            except BaseException:
                self.ctx.memory.give(self.owner, size)
                raise
            self.staging = staging
            self._taken[id(staging)] = size
        return self.staging

    def _close_staging(self, staging: "Staging") -> None:
        """Unmap staging (no transfer can touch it any more) and give its bytes back."""
        try:
            staging.close()
        finally:
            self.ctx.memory.give(self.owner, self._taken.pop(id(staging), 0))

    def _io(self) -> ThreadPoolExecutor:
        if self._pool is None:
            # One store call per half at most: a put's two halves are written at once (the
            # disk's queue stays full between calls); a get reads one group at a time.
            self._pool = ThreadPoolExecutor(2, thread_name_prefix=f"agent-io-{self.conn_id}")
        return self._pool

    def _groups(self, idx: Sequence[int], sizes: Sequence[int], split: bool = False
                ) -> list[list[int]]:
        """Block indices in groups that fill a staging half each, one store call per group (the
        store's cost is per call); with `split` (gets), in groups of at most a quarter of the
        request, so that NIXL moves one while the store reads the next: only the last group's
        move is not overlapped."""
        idx = list(idx)
        half = self._staging().half_size
        if split:
            total = sum(sizes[i] for i in idx)
            largest = max((sizes[i] for i in idx), default=0)
            half = min(half, max(largest, -(-total // 4)))
        return protocol.pack(idx, sizes, half)

    def _drain(self, half: int | None = None) -> None:
        """Wait for the store writes still reading staging (one half, or both)."""
        for h in (0, 1) if half is None else (half,):
            fut, self._writing[h] = self._writing[h], None
            if fut is not None:
                futures.wait([fut])

    def _abandon(self, pending: list, peer: str) -> None:
        """A transfer outlived its deadline: hold the staging memory (both halves) until NIXL
        says the transfer is final; the next request gets fresh staging."""
        if not pending or self.staging is None:
            return
        self._drain()
        staging = self.staging
        self._mover().quarantine.hold(pending[0], peer, 1, lambda: self._close_staging(staging),
                                      owner=self.owner, nbytes=2 * staging.half_size)
        self.ctx.count("staging_quarantined")
        self.staging = None

    def put(self, req: protocol.Blocks, todo: list[int], ok: list[bool | None], peer: str,
            deadline: float, settle: Settle | None = None) -> None:
        """With `settle`, a group whose store write is still running at the end is not waited
        for: its blocks are set None (received: the write reports to `settle` once done) and the
        write goes on while the next request's NIXL READ fills the other half."""
        mover = self._mover()
        mover.quarantine.reap()
        try:
            staging = self._staging()
        except NoMemory:
            return                                       # its blocks stay unmoved: misses
        mine: list[tuple[list[int], Future]] = []        # this request's store writes
        pending: list = []                               # a READ that outlived the deadline
        for group in self._groups(todo, req.sizes):
            h = self._half = 1 - self._half              # alternating, across requests too
            self._drain(h)                               # the half's previous write is done
            view, base = staging.half(h)
            local, remote, off = _pairs(req, group, base)
            if time.monotonic() > deadline:
                break
            if not nixl_util.run_xfer(mover.agent, "READ", local, remote, peer, deadline,
                                      on_pending=pending.append):
                if not pending:      # ended in error: none of these blocks is stored
                    self.ctx.count("blocks_nixl_failed", len(group))
                break
            self.ctx.count("bytes_nixl_in", off)
            self.ctx.count("blocks_staged_in", len(group))
            blocks, off = [], 0
            for i in group:
                blocks.append([view[off:off + req.sizes[i]]])
                off += req.sizes[i]
            # Before it is acknowledged: what the READ landed has the checksum the host sent.
            group, blocks = self._checked(req, group, blocks)
            if not group:
                continue
            # The store writes this group while NIXL reads the next one into the other half.
            fut = self._io().submit(self._store_put, [req.keys[i] for i in group], blocks)
            self._writing[h] = fut
            mine.append((group, fut))
        self._abandon(pending, peer)
        for group, fut in mine:
            if settle is not None and not fut.done():
                for i in group:
                    ok[i] = None
                fut.add_done_callback(functools.partial(_settled, settle,
                                                        [req.keys[i] for i in group]))
            else:
                for i, flag in zip(group, _flags(fut, len(group))):
                    ok[i] = flag

    def _checked(self, req: protocol.Blocks, group: list[int], blocks: list
                 ) -> tuple[list[int], list]:
        """The blocks of `group` whose bytes in staging have the checksum the host sent with the
        PUT (`offload.agent.sums`); the others are not stored (a miss, counted)."""
        if req.sums is None:
            return group, blocks
        good = [sums.of_views(b) == req.sums[i] for i, b in zip(group, blocks)]
        if all(good):
            return group, blocks
        self.ctx.count("checksum_mismatch_in", good.count(False))
        self.ctx.warn("checksum-in", self.owner, "%d block(s) read from host key %s do not have "
                      "the checksum it sent: not stored", good.count(False), self.owner)
        return ([i for i, g in zip(group, good) if g], [b for b, g in zip(blocks, good) if g])

    def _store_put(self, keys: list[bytes], blocks: list) -> list[bool]:
        return self.ctx.store.put_many(keys, blocks)

    def get(self, req: protocol.Blocks, todo: list[int], ok: list[bool], peer: str,
            deadline: float, out_sums: list[int] | None = None) -> None:
        mover = self._mover()
        mover.quarantine.reap()
        try:
            staging = self._staging()
        except NoMemory:
            return
        self._drain()                                    # earlier puts' writes leave staging
        pending: list = []                               # a WRITE that outlived the deadline
        groups = self._groups(todo, req.sizes, split=True)
        reading = self._io().submit(self._store_get, req, groups[0], 0) if groups else None
        for g, group in enumerate(groups):
            assert reading is not None
            try:
                flags, offs, got = reading.result()
            except Exception as e:  # noqa: BLE001
                log.warning("store read failed: %s", e)
                reading = None
                break
            # The store reads the next group into the other half while NIXL writes this one.
            reading = (self._io().submit(self._store_get, req, groups[g + 1], (g + 1) % 2)
                       if g + 1 < len(groups) and time.monotonic() < deadline else None)
            hits = [i for i, f in zip(group, flags) if f]
            if out_sums is not None:
                for i, c in zip(group, got):
                    out_sums[i] = c
            if not hits or time.monotonic() > deadline:
                continue
            _, base = staging.half(g % 2)
            local, remote, nbytes = _pairs(req, hits, base, [o for o, f in zip(offs, flags) if f])
            if nixl_util.run_xfer(mover.agent, "WRITE", local, remote, peer, deadline,
                                  on_pending=pending.append):
                self.ctx.count("bytes_nixl_out", nbytes)
                self.ctx.count("blocks_staged_out", len(hits))
                for i in hits:
                    ok[i] = True
            elif pending:
                break        # this half is still being read: nothing more goes through staging
            else:            # ended in error: these blocks are misses
                self.ctx.count("blocks_nixl_failed", len(hits))
        if reading is not None:
            try:
                reading.result()     # never leave a read into staging running past this request
            except Exception:  # noqa: BLE001 - already logged or irrelevant now
                pass
        self._abandon(pending, peer)

    def _store_get(self, req: protocol.Blocks, group: list[int], half: int
                   ) -> tuple[list[bool], list[int], list[int]]:
        """The store reads a group into a staging half: (flags, offsets, each block's checksum
        for the host to check, 0 for a miss)."""
        view, _ = self._staging().half(half)
        dests, offs, off = [], [], 0
        for i in group:
            dests.append([view[off:off + req.sizes[i]]])
            offs.append(off)
            off += req.sizes[i]
        flags = self.ctx.store.get_many([req.keys[i] for i in group], dests)
        return flags, offs, [sums.of_views(d) if f else 0 for d, f in zip(dests, flags)]


def _flags(fut: Future, n: int) -> list[bool]:
    """A store write's flags (all False if it failed: the store never raises; be sure of it)."""
    try:
        return list(fut.result())
    except Exception as e:  # noqa: BLE001
        log.warning("store call failed: %s", e)
        return [False] * n


def _settled(settle: Settle, keys: list[bytes], fut: Future) -> None:
    settle(keys, _flags(fut, len(keys)))


def _pairs(req: protocol.Blocks, group: Sequence[int], base: int,
           offs: Sequence[int] | None = None) -> tuple[list, list, int]:
    """Matching (local staging, remote host) descriptor lists for a group of blocks."""
    local, remote, off = [], [], 0
    for k, i in enumerate(group):
        o = offs[k] if offs is not None else off
        for addr, n in req.descs[i]:           # type: ignore[index]
            local.append((base + o, n))
            remote.append((addr, n))
            o += n
        off += req.sizes[i]
    return local, remote, off
