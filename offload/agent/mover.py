"""The agent's byte mover: one NIXL agent (UCX) for all hosts, and per-connection staging memory.

Primitives:
- `Mover(name)`: the agent-side NIXL agent. `add_peer(md)` loads a host's metadata (its registered
  host KV pool) and returns the host's NIXL name; `drop_peer(name)` forgets it when its last
  connection closes. A name already held by another live connection is refused (no hijacking).
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
        self._peers: dict[str, int] = {}   # host NIXL name -> owning connection id

    def add_peer(self, metadata: bytes, owner: int) -> str:
        with self._lock:
            try:
                name = self.agent.add_remote_agent(bytes(metadata))
            except Exception as e:  # noqa: BLE001 - NIXL raises its own types
                raise PeerError(f"NIXL metadata rejected: {e}") from None
            name = name.decode() if isinstance(name, bytes) else str(name)
            holder = self._peers.get(name)
            if holder is not None and holder != owner:
                raise PeerError(f"NIXL agent name {name!r} is in use by another connection")
            self._peers[name] = owner
            return name

    def update_peer(self, name: str, metadata: bytes, owner: int) -> str:
        """New metadata of a known host (it registered more memory)."""
        with self._lock:
            if self._peers.get(name) == owner:
                self._invalidate(name)
                del self._peers[name]
        return self.add_peer(metadata, owner)

    def drop_peer(self, name: str, owner: int) -> None:
        with self._lock:
            if self._peers.get(name) == owner:
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
