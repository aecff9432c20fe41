"""The agent's byte mover: one NIXL agent (UCX) for all hosts, and per-connection staging memory.

Primitives:
- `Mover(name)`: the agent-side NIXL agent. `add_peer(md, conn, host, tenant)` loads a host's metadata
  (its registered host KV pool) and returns its NIXL name, which must be `host` or start with
  `host/` (read from the metadata *before* loading it); metadata not loaded before is first
  checked and loaded by a child process (`offload.agent.vet`), so that what makes UCX abort
  kills the child, not the agent (the child's time charged to `tenant`, the host key);
  several connections of one host share a
  peer; `update_peer(old, md, conn, host)` loads newer metadata and releases the old peer;
  `drop_peer(name, conn)` forgets a peer when its last connection closes (once none of its
  transfers runs: `Quarantine.drop_peer`). A loaded peer is not
  used until proven: `challenge(name, tag)` sends a fresh nonce to the endpoint the metadata
  names (a NIXL notification), `prove(name, md)` marks it usable once the host echoed it over
  its authenticated connection, `proven(name)`; newer metadata under the name is unproven again
  (a renamed copy of another host's metadata names that host's endpoint, which never tells the
  presenter the nonce). `read_back(name, addr, n, deadline, owner)`: `n` bytes of the peer's
  registered memory, NIXL READ through its endpoint (how the proof is checked: the host writes
  a MAC only it can compute there). `covers(name, descs)`: descriptors lie in memory the peer
  registered.
  `.quarantine`: the memory its transfers past their deadline still hold
  (`offload.agent.quarantine`), freed for a peer's once NIXL forgot it. `.pool`: threads for the
  DRAM tier's checksums, overlapped with the transfers (`offload.agent.direct`).
- `Staging(mover, size)`: an anonymous, page-aligned mapping registered with NIXL once, split in
  two halves for double buffering (NIXL moves one half while the store reads/writes the other).
  Page alignment lets an O_DIRECT store use it without a bounce buffer.
- `Arena(mover, base, size)`: a block store's arena (the DRAM tier's slots), registered with NIXL
  lazily in `CHUNK` pieces as blocks are placed in it (RDMA pins registered memory; most of a
  large arena is untouched address space), so NIXL moves blocks straight to/from their slots.
The zero-copy moves through an `Arena` are `offload.agent.direct`.
Lifecycle: the server creates one `Mover` at start (only with `--transport ucx`); each connection
that moves bytes by NIXL gets a `Staging`, closed with the connection.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

from offload.agent import nixl_util
from offload.agent.protocol import PROOF_MAGIC, PROOF_NONCE_BYTES
from offload.agent.quarantine import Quarantine
from offload.agent.vet import Vetter

log = logging.getLogger(__name__)
SUM_THREADS = 2               # checksum threads (xxh3 frees the GIL): about a core each
ADDRESS_END = 1 << 64          # a descriptor must end below it: NIXL would wrap around


class PeerError(Exception):
    """A host's NIXL metadata cannot be used."""


@dataclass
class _Peer:
    md: bytes                  # the metadata NIXL holds for this name
    host: str                  # the authenticated host it belongs to
    owners: set[int]           # the connections using it
    proven: bool = False       # its endpoint echoed a nonce sent to it (`prove`)


class Mover:
    def __init__(self, name: str):
        self.name = name
        self.agent: Any = nixl_util.make_agent(name)
        self.vetter = Vetter()          # tenant metadata is loaded by its child first
        self.vetter.start()
        self.quarantine = Quarantine(self.agent)
        # Where the DRAM tier's checksums run while a session's thread moves the next chunk
        # (`offload.agent.direct`); its threads start on first use.
        self.pool = ThreadPoolExecutor(SUM_THREADS, thread_name_prefix="agent-sums")
        self._lock = threading.Lock()
        # host NIXL name -> peer. A host may hold several connections; the peer is forgotten
        # when the last one closes.
        self._peers: dict[str, _Peer] = {}

    def add_peer(self, metadata: bytes, owner: int, host: str, tenant: str = "") -> str:
        """Load the metadata of connection `owner` of `host` (once per distinct metadata; its
        check in the child charged to host key `tenant`). Newer metadata under a known name is
        unproven until `prove`d again."""
        md = bytes(metadata)
        name = nixl_util.metadata_name(md)
        if name is None:
            raise PeerError("unrecognised NIXL metadata")
        if name != host and not name.startswith(host + "/"):
            raise PeerError(f"NIXL metadata of agent {name!r} does not belong to host {host!r}")
        with self._lock:
            known = self._peers.get(name)
            fresh = known is None or known.md != md
        if fresh:           # loaded by a child first: UCX may abort on what it cannot unpack
            why = self.vetter.vet(md, tenant)
            if why is not None:
                raise PeerError(why)
        with self._lock:
            peer = self._peers.get(name)
            if peer is None:
                peer = _Peer(b"", host, set())
            if peer.host != host:
                raise PeerError(f"NIXL peer {name!r} belongs to another connection's host")
            if peer.md != md:
                try:
                    # NIXL reloads a known peer's newer metadata in place (more registered memory).
                    loaded = self.agent.add_remote_agent(md)
                except Exception as e:  # noqa: BLE001 - NIXL raises its own types
                    raise PeerError(f"NIXL metadata rejected: {e}") from None
                loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
                if loaded != name:       # never expected: the name is read from the same bytes
                    self._invalidate(loaded)
                    raise PeerError(f"NIXL loaded agent {loaded!r}, the metadata names {name!r}")
                peer.md, peer.proven = md, False
            peer.owners.add(owner)
            self._peers[name] = peer
            self.quarantine.revive(name)     # a dropped name in use again: not forgotten
            return name

    def update_peer(self, old: str, metadata: bytes, owner: int, host: str, tenant: str = ""
                    ) -> str:
        """New metadata of connection `owner`; the peer it replaces is released."""
        name = self.add_peer(metadata, owner, host, tenant)
        if name != old:
            self.drop_peer(old, owner)
        return name

    def challenge(self, name: str, tag: bytes) -> tuple[bytes, bytes]:
        """Send a fresh nonce to the endpoint of peer `name` (a NIXL notification tagged `tag`);
        returns (nonce, the metadata it was sent for). Raises PeerError."""
        with self._lock:
            peer = self._peers.get(name)
            if peer is None:
                raise PeerError(f"unknown NIXL peer {name!r}")
            md = peer.md
        nonce = os.urandom(PROOF_NONCE_BYTES)
        try:
            self.agent.send_notif(name, PROOF_MAGIC + tag + nonce)
        except Exception as e:  # noqa: BLE001
            raise PeerError(f"cannot reach the NIXL endpoint of {name!r}: {e}") from None
        return nonce, md

    def prove(self, name: str, md: bytes) -> bool:
        """The nonce sent for `md` came back: peer `name` is usable, if `md` is still its
        metadata."""
        with self._lock:
            peer = self._peers.get(name)
            if peer is None or peer.md != md:
                return False
            peer.proven = True
            return True

    def proven(self, name: str | None) -> bool:
        with self._lock:
            peer = self._peers.get(name) if name is not None else None
            return peer is not None and peer.proven

    def covers(self, name: str, descs: Sequence[tuple[int, int]]) -> bool:
        """Whether every (address, length) lies in memory peer `name` registered (its metadata).
        An empty or wrapping descriptor never does (NIXL's own check computes the end modulo
        2**64: a descriptor ending past 2**64 would pass it)."""
        if not descs:
            return True
        if any(n <= 0 or a + n >= ADDRESS_END for a, n in descs):
            return False
        try:
            dl = self.agent.get_xfer_descs([(a, n, 0) for a, n in descs], "DRAM")
            return bool(self.agent.check_remote_metadata(name, dl))
        except Exception as e:  # noqa: BLE001
            log.warning("checking descriptors of %s: %s", name, e)
            return False

    def read_back(self, name: str, addr: int, n: int, deadline: float, owner: str
                  ) -> bytes | None:
        """`n` bytes at `addr` in the memory peer `name` registered, READ through its endpoint;
        None if outside that memory or not read by `deadline` (its buffer then quarantined)."""
        if not self.covers(name, [(addr, n)]):
            return None
        buf = mmap.mmap(-1, mmap.PAGESIZE)
        base, _ = nixl_util.region_of(buf)
        try:
            reg = self.register(base, mmap.PAGESIZE)
        except Exception as e:  # noqa: BLE001
            log.warning("registering a proof buffer: %s", e)
            buf.close()
            return None

        def close() -> None:
            self.deregister(reg)
            buf.close()

        pending: list[Any] = []
        ok = nixl_util.run_xfer(self.agent, "READ", [(base, n)], [(addr, n)], name, deadline,
                                on_pending=pending.append)
        if pending:
            self.quarantine.hold(pending[0], name, 1, close, owner=owner, nbytes=mmap.PAGESIZE)
            return None
        data = buf[:n] if ok else None
        close()
        return data

    def close(self) -> None:
        self.vetter.close()

    def peers(self) -> int:
        with self._lock:
            return len(self._peers)

    def drop_peer(self, name: str, owner: int) -> None:
        with self._lock:
            peer = self._peers.get(name)
            if peer is None:
                return
            peer.owners.discard(owner)
            if peer.owners:
                return
            del self._peers[name]
        # Forgotten once none of its transfers runs; what they held freed once each is final.
        self.quarantine.drop_peer(name, lambda: self._forget(name))

    def _forget(self, name: str) -> None:
        """A dropped peer none of whose transfers runs: NIXL forgets it, unless a connection
        loaded the name again meanwhile."""
        with self._lock:
            if name in self._peers:
                return
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
