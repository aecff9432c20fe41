"""The agent's byte mover: one NIXL agent (UCX) for all hosts, and per-connection staging memory.

Primitives:
- `Mover(name)`: the agent-side NIXL agent. `add_peer(md, conn)` loads a host's metadata (its
  registered host KV pool) and returns the host's NIXL name; several connections of one host share
  it; newer metadata of the same host replaces the old; `drop_peer(name, conn)` forgets it when
  its last connection closes.
- `Staging(mover, size)`: an anonymous, page-aligned mapping registered with NIXL once, split in
  two halves for double buffering (NIXL moves one half while the store reads/writes the other).
  Page alignment lets an O_DIRECT store use it without a bounce buffer.
Lifecycle: the server creates one `Mover` at start (only with `--transport ucx`); each connection
that moves bytes by NIXL gets a `Staging`, closed with the connection.
"""

from __future__ import annotations

import logging
import mmap
import threading
from typing import Any

from offload.transfer import nixl_util

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
