"""Memory a NIXL transfer may still touch: held until NIXL says the transfer is final.

A transfer still running at its request's deadline is not over: UCX may yet land its bytes (a
READ into a store slot or staging memory) or read them (a WRITE from a pinned slot). Freeing that
memory at the deadline lets a late transfer overwrite the next block placed there, or send it to
the wrong host. So its handle and a `release` callback (free the slots, unpin them, close the
staging) are held here until the transfer is final: NIXL reports DONE or ERR, or its peer is torn
down (`drop_peer`, after NIXL forgot the peer: UCX cancels what its endpoint had in flight).

Primitives: `Quarantine(agent)`; `.hold(handle, peer, blocks, release)`; `.reap()` (polls every
held transfer, runs the release of the final ones; called before each transfer and at each
connection's close); `.drop_peer(peer, forget)`; `.held()` -> blocks held now; `.total` -> ever held.
Never raises.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

from offload.agent import nixl_util

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Held:
    handle: Any
    peer: str
    blocks: int
    release: Callable[[], None]


class Quarantine:
    def __init__(self, agent: Any):
        self._agent = agent
        self._lock = threading.Lock()
        self._held: list[_Held] = []
        self.total = 0                  # blocks (or staging areas) ever quarantined

    def hold(self, handle: Any, peer: str, blocks: int, release: Callable[[], None]) -> None:
        """Keep `release` from running until the transfer `handle` is final."""
        with self._lock:
            self._held.append(_Held(handle, peer, blocks, release))
            self.total += blocks
        log.info("quarantined %d block(s) of a transfer with %s still running at its deadline",
                 blocks, peer)

    def held(self) -> int:
        with self._lock:
            return sum(h.blocks for h in self._held)

    def reap(self) -> int:
        """Release what final transfers held; returns the blocks released."""
        return self._finish(lambda h: nixl_util.xfer_state(self._agent, h.handle) != "PROC")

    def drop_peer(self, peer: str, forget: Callable[[], None]) -> int:
        """The peer's connections are gone: its transfers are released (NIXL cancels them), the
        peer is forgotten (`forget`: UCX closes its endpoint), then what they held is freed."""
        return self._finish(lambda h: h.peer == peer or
                            nixl_util.xfer_state(self._agent, h.handle) != "PROC", forget)

    def _finish(self, final: Callable[[_Held], bool],
                forget: Callable[[], None] | None = None) -> int:
        with self._lock:
            done = [h for h in self._held if final(h)]
            self._held = [h for h in self._held if h not in done]
        for h in done:
            nixl_util.release(self._agent, h.handle)
        if forget is not None:
            forget()
        for h in done:
            try:
                h.release()
            except Exception as e:  # noqa: BLE001 - one failed release must not leak the others
                log.warning("releasing quarantined memory failed: %s", e)
        return sum(h.blocks for h in done)
