"""The agent's byte mover: one NIXL agent (UCX) for all hosts, and per-connection staging memory.

Primitives:
- `Mover(name)`: the agent-side NIXL agent. `add_peer(md, conn)` loads a host's metadata (its
  registered host KV pool) and returns the host's NIXL name; several connections of one host share
  it; newer metadata of the same host replaces the old; `drop_peer(name, conn)` forgets it when
  its last connection closes.
- `direct_put(server, peer, req, todo, ok, deadline)` / `direct_get(...)`: the zero-copy moves
  for a store with an arena: NIXL READs a PUT's blocks into slots from `reserve_views` (then
  `commit_views`), WRITEs a GET's blocks from slots held by `pin_views` (then `unpin`); each
  returns the blocks it left to the staging path. Never raise.
- `Staging(mover, size)`: an anonymous, page-aligned mapping registered with NIXL once, split in
  two halves for double buffering (NIXL moves one half while the store reads/writes the other).
  Page alignment lets an O_DIRECT store use it without a bounce buffer.
- `Arena(mover, base, size)`: a block store's arena (the DRAM tier's slots), registered with NIXL
  lazily in `CHUNK` pieces as blocks are placed in it (RDMA pins registered memory; most of a
  large arena is untouched address space), so NIXL moves blocks straight to/from their slots.
Lifecycle: the server creates one `Mover` at start (only with `--transport ucx`); each connection
that moves bytes by NIXL gets a `Staging`, closed with the connection.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from typing import TYPE_CHECKING, Any, Sequence

from offload.agent import nixl_util

if TYPE_CHECKING:
    from offload.agent.protocol import Blocks
    from offload.agent.server import AgentServer

log = logging.getLogger(__name__)


class PeerError(Exception):
    """A host's NIXL metadata cannot be used."""


class Mover:
    def __init__(self, name: str):
        self.name = name
        self.agent: Any = nixl_util.make_agent(name)
        self._lock = threading.Lock()
        # host NIXL name -> (its metadata, the connections using it). A host may hold several
        # connections; the peer is forgotten when the last one closes.
        self._peers: dict[str, tuple[bytes, set[int]]] = {}

    def add_peer(self, metadata: bytes, owner: int) -> str:
        """Load a host's metadata (once per distinct metadata) for connection `owner`."""
        md = bytes(metadata)
        with self._lock:
            for name, (known, owners) in self._peers.items():
                if known == md:
                    owners.add(owner)
                    return name
            try:
                # NIXL reloads a known host's newer metadata in place (more registered memory).
                name = self.agent.add_remote_agent(md)
            except Exception as e:  # noqa: BLE001 - NIXL raises its own types
                raise PeerError(f"NIXL metadata rejected: {e}") from None
            name = name.decode() if isinstance(name, bytes) else str(name)
            owners = self._peers.get(name, (b"", set()))[1]
            owners.add(owner)
            self._peers[name] = (md, owners)
            return name

    def update_peer(self, name: str, metadata: bytes, owner: int) -> str:
        """New metadata of a known host (it registered more memory)."""
        return self.add_peer(metadata, owner)

    def drop_peer(self, name: str, owner: int) -> None:
        with self._lock:
            entry = self._peers.get(name)
            if entry is None:
                return
            entry[1].discard(owner)
            if not entry[1]:
                del self._peers[name]
                self._invalidate(name)

    def _invalidate(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception as e:  # noqa: BLE001
            log.debug("forgetting NIXL peer %s: %s", name, e)

    def register(self, addr: int, size: int) -> Any:
        return self.agent.register_memory([(addr, size, 0, "")], "DRAM")

    def deregister(self, reg: Any) -> None:
        try:
            self.agent.deregister_memory(reg)
        except Exception as e:  # noqa: BLE001
            log.debug("deregistering staging memory: %s", e)


class Arena:
    """A store's arena, registered with NIXL chunk by chunk on first use."""

    CHUNK = 256 << 20

    def __init__(self, mover: Mover, base: int, size: int, chunk: int = CHUNK):
        self.base, self.size, self.chunk = base, size, chunk
        self._mover = mover
        self._regs: list[Any] = []
        self._done = 0                  # bytes registered from base
        self._lock = threading.Lock()

    def covers(self, addr: int, n: int) -> bool:
        """Whether [addr, addr+n) lies in the arena, registering the chunks it needs first."""
        end = addr + n - self.base
        if addr < self.base or end > self.size:
            return False
        if end <= self._done:
            return True
        with self._lock:
            while self._done < end:
                k = min(self.chunk, self.size - self._done)
                try:
                    self._regs.append(self._mover.register(self.base + self._done, k))
                except Exception as e:  # noqa: BLE001 - the caller falls back to staging
                    log.warning("registering the store's memory with NIXL failed: %s", e)
                    return False
                self._done += k
        return True

    def pieces(self, local: int, remote: int, n: int) -> list[tuple[int, int, int]]:
        """(local, remote, length) pieces of one copy, split where registered chunks meet."""
        out = []
        while n > 0:
            k = min(n, self.chunk - (local - self.base) % self.chunk)
            out.append((local, remote, k))
            local, remote, n = local + k, remote + k, n - k
        return out

    def close(self) -> None:
        with self._lock:
            for reg in self._regs:
                self._mover.deregister(reg)
            self._regs, self._done = [], 0


class Staging:
    """Two halves of page-aligned memory registered with NIXL."""

    def __init__(self, mover: Mover, size: int):
        self.half_size = max(mmap.PAGESIZE, (size // 2) // mmap.PAGESIZE * mmap.PAGESIZE)
        self._map = mmap.mmap(-1, 2 * self.half_size)
        self.view = memoryview(self._map)
        self.base, _ = nixl_util.region_of(self.view)
        self._mover = mover
        self._reg = mover.register(self.base, 2 * self.half_size)

    def half(self, i: int) -> tuple[memoryview, int]:
        """(view, address) of half i (0 or 1)."""
        start = i * self.half_size
        return self.view[start:start + self.half_size], self.base + start

    def close(self) -> None:
        self._mover.deregister(self._reg)
        self.view.release()
        try:
            self._map.close()
        except BufferError:  # a view is still exported somewhere: leave it to the GC
            pass


def _split(server: "AgentServer", req: "Blocks", idx: Sequence[int], views: Sequence[Any]
           ) -> tuple[list[int], list[int], list, list]:
    """Blocks with a store slot that NIXL reaches (inside the registered arena) and the rest;
    returns (direct, rest, local descriptors, remote descriptors)."""
    arena = server.arena()
    direct, rest, local, remote = [], [], [], []
    for i, v in zip(idx, views):
        if v is None:
            continue
        addr, n = nixl_util.region_of(v)
        if n != req.sizes[i] or arena is None or not arena.covers(addr, n):
            rest.append(i)
            continue
        direct.append(i)
        for raddr, rn in req.descs[i]:       # type: ignore[index]
            for la, ra, k in arena.pieces(addr, raddr, rn):
                local.append((la, k))
                remote.append((ra, k))
            addr += rn
    return direct, rest, local, remote


def direct_put(server: "AgentServer", peer: str | None, req: "Blocks", todo: list[int],
               ok: list[bool], deadline: float) -> list[int]:
    """NIXL READs blocks straight into reserved store slots; returns the blocks left for the
    staging path (the store has no arena, or gave no slot)."""
    store: Any = server.store
    if not todo or peer is None or server.arena() is None:
        return todo
    views = store.reserve_views([req.keys[i] for i in todo], [req.sizes[i] for i in todo])
    direct, rest, local, remote = _split(server, req, todo, views)
    if rest:
        store.commit_views([req.keys[i] for i in rest], [False] * len(rest))
    rest += [i for i, v in zip(todo, views) if v is None]
    if direct:
        good = time.monotonic() < deadline and nixl_util.run_xfer(
            server.mover.agent, "READ", local, remote, peer, deadline)
        flags = store.commit_views([req.keys[i] for i in direct], [good] * len(direct))
        for i, f in zip(direct, flags):
            ok[i] = f
        if good:
            server.count("bytes_nixl_in", sum(req.sizes[i] for i in direct))
            server.count("blocks_direct_in", len(direct))
    return sorted(rest)


def direct_get(server: "AgentServer", peer: str | None, req: "Blocks", ok: list[bool],
               deadline: float) -> list[int]:
    """NIXL WRITEs stored blocks straight from their pinned slots; returns the blocks left for
    the staging path."""
    store: Any = server.store
    if peer is None or server.arena() is None:
        return list(range(len(req.keys)))
    views = store.pin_views(req.keys)
    direct, rest, local, remote = _split(server, req, range(len(req.keys)), views)
    if rest:
        store.unpin([req.keys[i] for i in rest], [False] * len(rest))
    if direct:
        good = time.monotonic() < deadline and nixl_util.run_xfer(
            server.mover.agent, "WRITE", local, remote, peer, deadline)
        store.unpin([req.keys[i] for i in direct], [good] * len(direct))
        for i in direct:
            ok[i] = good
        if good:
            server.count("bytes_nixl_out", sum(req.sizes[i] for i in direct))
            server.count("blocks_direct_out", len(direct))
    return rest
