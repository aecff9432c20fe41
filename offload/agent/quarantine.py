"""Memory a NIXL transfer may still touch: held until NIXL says the transfer is final.

A transfer still running at its request's deadline is not over: UCX may yet land its bytes (a
READ into a store slot or staging memory) or read them (a WRITE from a pinned slot). Freeing that
memory at the deadline lets a late transfer overwrite the next block placed there, or send it to
the wrong host. So its handle and a `release` callback (free the slots, unpin them, close the
staging) are held here until the transfer is final: NIXL reports DONE or ERR. That holds when its
peer goes too (`drop_peer`): UCX may still complete a READ after the host's connection closed and
even after NIXL forgot the peer (its endpoint's close flushes what it had in flight), so memory a
running transfer of a dropped peer touches stays held, and the peer itself is forgotten (`forget`)
only once none of its transfers runs any more (`reap` does it later). Only NIXL saying a transfer
is final frees what it held (a held handle is never released while it runs).

Primitives: `Quarantine(agent)`; `.hold(handle, peer, blocks, release, owner=, nbytes=)`; `.reap()`
(polls every held transfer, runs the release of the final ones, forgets the dropped peers none
of whose transfers runs; called before each transfer and at each connection's close);
`.drop_peer(peer, forget)`; `.revive(peer)` (a dropped peer's name loaded again: not
forgotten); `.dying()` -> dropped peers not forgotten yet; `.held()` -> blocks held now; `.total` ->
ever held; `.held_bytes(owner)` -> bytes held now (of one owner, or all).
Bounded per owner (a tenant: `offload.agent.access.Access.tenant`): a host that stalls its own
endpoint keeps every transfer unfinished, so without a bound it could quarantine the whole DRAM
tier. `.claim(owner, want, limit)` -> bytes a request may move straight into store slots (what
is left of `limit` after what the owner holds and what its other requests claimed), given back
with `.unclaim(owner, n)` when the request ends; the session refuses NIXL requests of an owner
holding `limit` or more. Never raises.
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
    owner: str
    nbytes: int


class Quarantine:
    def __init__(self, agent: Any):
        self._agent = agent
        self._lock = threading.Lock()
        self._held: list[_Held] = []
        self.total = 0                  # blocks (or staging areas) ever quarantined
        self._claimed: dict[str, int] = {}      # owner -> bytes its requests may still hold
        self._dying: dict[str, Callable[[], None]] = {}   # dropped peer -> its deferred forget

    def hold(self, handle: Any, peer: str, blocks: int, release: Callable[[], None], *,
             owner: str = "", nbytes: int = 0) -> None:
        """Keep `release` from running until the transfer `handle` is final."""
        with self._lock:
            self._held.append(_Held(handle, peer, blocks, release, owner, nbytes))
            self.total += blocks
        # A host that gives its transfers tiny budgets makes one per request: its own lines.
        nixl_util.warn_peer("quarantined", peer, "quarantined %d block(s) of a transfer with %s "
                            "still running at its deadline", blocks, peer, level=logging.INFO)

    def held(self) -> int:
        with self._lock:
            return sum(h.blocks for h in self._held)

    def held_bytes(self, owner: str | None = None) -> int:
        with self._lock:
            return sum(h.nbytes for h in self._held if owner is None or h.owner == owner)

    def claim(self, owner: str, want: int, limit: int) -> int:
        """Bytes (at most `want`) a request of `owner` may leave here, within `limit` in all."""
        with self._lock:
            used = sum(h.nbytes for h in self._held if h.owner == owner)
            n = max(0, min(want, limit - used - self._claimed.get(owner, 0)))
            if n:
                self._claimed[owner] = self._claimed.get(owner, 0) + n
            return n

    def unclaim(self, owner: str, n: int) -> None:
        if n:
            with self._lock:
                left = self._claimed.pop(owner, 0) - n
                if left > 0:
                    self._claimed[owner] = left

    def reap(self) -> int:
        """Release what final transfers held; returns the blocks released."""
        return self._finish()

    def drop_peer(self, peer: str, forget: Callable[[], None]) -> int:
        """The peer's connections are gone: it is forgotten (`forget`: NIXL removes it, UCX
        closes its endpoint) once none of its transfers runs, now or at a later `reap`; what a
        transfer held is freed only once NIXL says that transfer is final."""
        with self._lock:
            self._dying[peer] = forget
        return self._finish()

    def revive(self, peer: str) -> None:
        """A dropped peer's name is in use again (a reconnect loaded it): never forget it."""
        with self._lock:
            self._dying.pop(peer, None)

    def dying(self) -> int:
        """Dropped peers not forgotten yet (a transfer of theirs still runs)."""
        with self._lock:
            return len(self._dying)

    def _finish(self) -> int:
        with self._lock:
            held = list(self._held)
        done = [h for h in held if nixl_util.xfer_state(self._agent, h.handle) != "PROC"]
        with self._lock:
            self._held = [h for h in self._held if h not in done]
            running = {h.peer for h in self._held}
            gone = [(p, f) for p, f in self._dying.items() if p not in running]
            for p, _ in gone:
                del self._dying[p]
        for h in done:
            nixl_util.release(self._agent, h.handle)
        for p, forget in gone:
            try:
                forget()
            except Exception as e:  # noqa: BLE001
                log.warning("forgetting NIXL peer %s failed: %s", p, e)
        for h in done:
            try:
                h.release()
            except Exception as e:  # noqa: BLE001 - one failed release must not leak the others
                log.warning("releasing quarantined memory failed: %s", e)
        return sum(h.blocks for h in done)
