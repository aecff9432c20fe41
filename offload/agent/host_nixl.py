"""The host's NIXL side of an `AgentStore`: its NIXL agent and the memory it registered.

Primitives: `HostNixl(nixl_name, landing_bytes)`, empty until `register(buffer)` (control path)
loads NIXL, creates this process's NIXL agent `nixl_name`, registers the proof area and the
landing area (`offload.agent.landing`), then the buffer (the host KV pool); `descs(bufs)` is the
(address, length) of each buffer when all lie in registered memory; `metadata()` this NIXL
agent's metadata (sent in HELLO / METADATA); `proof_nonces(tag, deadline)` the nonces the agent
sent under a connection's proof tag; `proof_area(macs)` where their MACs lie in registered memory
while the agent reads them back (PROVE); `close()` deregisters everything. `lock` guards it all.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from offload.agent import protocol
from offload.agent.landing import Landing

log = logging.getLogger("offload.agent.client")
PROOF_SLOTS = 16                  # connections of this process proving their endpoint at once
PROOF_SLOT = protocol.MAX_PROOF_NONCES * protocol.PROOF_MAC_BYTES


class HostNixl:
    def __init__(self, nixl_name: str, landing_bytes: int):
        self.nixl_name = nixl_name
        self.lock = threading.RLock()
        self.agent: Any = None                         # this process's NIXL agent, once loaded
        self.landing: Landing | None = None            # where GETs' NIXL WRITEs land
        self._landing_bytes = landing_bytes
        self._regions: list[tuple[int, int]] = []     # registered [start, end)
        self._regs: list[Any] = []
        self._proofs: dict[bytes, list[bytes]] = {}   # proof tag -> nonces received (NIXL)
        self._proof_area: Any = None                   # registered: proof MACs, one slot each
        self._proof_free: list[int] = []

    def register(self, buffer: Any) -> None:
        """Register `buffer` with NIXL (loaded, with the proof and landing areas, the first
        time). Raises PathUnavailableError if NIXL cannot be loaded."""
        from offload.agent import nixl_util

        addr, size = nixl_util.region_of(buffer)
        with self.lock:
            if self.agent is None:
                self.agent = nixl_util.make_agent(self.nixl_name)
                self._register_proof_area()
                self.landing = Landing(self._landing_bytes)
                self._regs.append(self.landing.register(self.agent))
            self._regs.append(self.agent.register_memory([(addr, size, 0, "")], "DRAM"))
            self._regions.append((addr, addr + size))

    def _register_proof_area(self) -> None:
        """Registered memory where a connection proving its endpoint puts its MACs (lock held)."""
        import numpy as np

        self._proof_area = np.zeros(PROOF_SLOTS * PROOF_SLOT, np.uint8)
        self._regs.append(self.agent.register_memory(
            [(self._proof_area.ctypes.data, self._proof_area.nbytes, 0, "")], "DRAM"))
        self._proof_free = list(range(PROOF_SLOTS))

    @contextmanager
    def proof_area(self, macs: list[bytes]) -> Iterator[int | None]:
        """Where `macs` lie, back to back, in registered memory while the agent reads them
        (PROVE); None when every slot is in use or NIXL is not loaded."""
        import numpy as np

        with self.lock:
            area = self._proof_area
            i = self._proof_free.pop() if area is not None and self._proof_free else None
        if i is None:
            yield None
            return
        view = area[i * PROOF_SLOT:(i + 1) * PROOF_SLOT]
        data = b"".join(macs)[:PROOF_SLOT]
        try:
            view[:len(data)] = np.frombuffer(data, np.uint8)
            yield int(area.ctypes.data) + i * PROOF_SLOT
        finally:
            view[:] = 0
            with self.lock:
                if self._proof_area is area:
                    self._proof_free.append(i)

    def descs(self, bufs: Sequence[Any]) -> list[tuple[int, int]] | None:
        """(address, length) per buffer if all lie in registered memory, else None."""
        if not self._regions:
            return None
        from offload.agent.nixl_util import region_of

        out = []
        for b in bufs:
            try:
                addr, n = region_of(b)
            except (TypeError, ValueError):
                return None
            if n == 0:
                continue
            if not any(s <= addr and addr + n <= e for s, e in self._regions):
                return None
            out.append((addr, n))
        return out

    def metadata(self) -> bytes | None:
        with self.lock:
            return self.agent.get_agent_metadata() if self.agent is not None else None

    def proof_nonces(self, tag: bytes, deadline: float) -> list[bytes]:
        """The nonces the agent sent this host's NIXL agent under `tag` (a connection's proof
        tag), waiting for one until `deadline`. Notifications for other connections are kept
        for them (bounded); anything else is dropped."""
        prefix = protocol.PROOF_MAGIC + tag
        size = len(prefix) + protocol.PROOF_NONCE_BYTES
        while True:
            with self.lock:
                if self.agent is None:
                    return []
                for msgs in self.agent.get_new_notifs().values():
                    for m in msgs:
                        m = bytes(m)
                        if len(m) == size and m.startswith(protocol.PROOF_MAGIC):
                            got = self._proofs.setdefault(m[4:4 + protocol.PROOF_TAG_BYTES], [])
                            got.append(m[len(prefix):])
                            del got[:-protocol.MAX_PROOF_NONCES]
                while len(self._proofs) > 64:
                    self._proofs.pop(next(iter(self._proofs)))
                mine = self._proofs.pop(tag, [])
            if mine or time.monotonic() > deadline:
                return mine
            time.sleep(0.002)

    def close(self) -> None:
        """Deregister everything; NIXL, the proof and landing areas are forgotten."""
        with self.lock:
            if self.agent is not None:
                for reg in self._regs:
                    try:
                        self.agent.deregister_memory(reg)
                    except Exception as e:  # noqa: BLE001
                        log.debug("deregistering host memory: %s", e)
                self._regs.clear()
                self._regions.clear()
                self.agent = self._proof_area = self.landing = None
