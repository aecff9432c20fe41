"""Where the agent's NIXL WRITEs of a GET land on the host: a client-owned registered area, never
the caller's pages.

The promise it keeps (docs/security/agent.md, "Pages the host gave up on"): a page `get_many`
reported as a miss is never written afterwards by the agent. NIXL cannot recall a WRITE already
posted, and an agent that is stopped, slow or overloaded may post or finish one after the host's
deadline; so the agent is only ever given descriptors inside this area, and the host copies a
block into the caller's pages itself, after a good reply, then checks the checksum the agent sent
on the caller's pages (`BlockCalls._send_batch`). The one enforcement point:
`BlockCalls._get_landed` (`offload.agent.calls`), which builds every GET's descriptors from
`Landing.take`.

Primitives: `Landing(size)` (memory only; `register(nixl)` registers it once NIXL is loaded),
`take(n)` -> the address of `n` free bytes, or None (the caller's blocks then travel on the
control connection, copied the same way); `give(addr)` once the reply came (the agent's WRITEs
of the blocks it reported loaded are done; one it gave up on at its own deadline may still land);
`hold(addr)` once the host gave up on the request: the extent is not handed out again for
`HOLD_S`, so a late WRITE lands in nothing anyone reads. A WRITE landing later still, in an
extent reused meanwhile, can only make a block fail the checksum on the caller's pages (a miss):
the landing area is never what the promise rests on, the copy after a good reply is.
`held()` -> bytes held.
"""

from __future__ import annotations

import threading
import time
from typing import Any

DEFAULT_BYTES = 256 << 20     # GETs in flight at once over NIXL, all connections of a store
HOLD_S = 60.0                 # an extent of a GET the host gave up on is not reused before this
ALIGN = 4096


class Landing:
    def __init__(self, size: int = DEFAULT_BYTES):
        import numpy as np

        self.size = max(ALIGN, size // ALIGN * ALIGN)
        self.buf = np.empty(self.size, np.uint8)       # pages are touched by the first WRITE
        self.base = int(self.buf.ctypes.data)
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.size)]    # (offset, length), sorted
        self._used: dict[int, int] = {}                          # offset -> length
        self._held: dict[int, tuple[int, float]] = {}            # offset -> (length, until)
        self.reg: Any = None

    def register(self, nixl: Any) -> Any:
        """Register the area with this process's NIXL agent (once); the registration handle."""
        if self.reg is None:
            self.reg = nixl.register_memory([(self.base, self.size, 0, "")], "DRAM")
        return self.reg

    def take(self, n: int) -> int | None:
        """The address of `n` bytes of the area no one else uses, or None (no room now)."""
        n = max(ALIGN, -(-n // ALIGN) * ALIGN)
        with self._lock:
            self._expire(time.monotonic())
            for j, (off, length) in enumerate(self._free):
                if length >= n:
                    if length == n:
                        del self._free[j]
                    else:
                        self._free[j] = (off + n, length - n)
                    self._used[off] = n
                    return self.base + off
        return None

    def give(self, addr: int) -> None:
        """The agent answered the request whose blocks landed at `addr`: the extent is free."""
        with self._lock:
            n = self._used.pop(addr - self.base, None)
            if n is not None:
                self._put_back(addr - self.base, n)

    def hold(self, addr: int) -> None:
        """The host gave up on the request at `addr`: not handed out again for `HOLD_S`."""
        with self._lock:
            n = self._used.pop(addr - self.base, None)
            if n is not None:
                self._held[addr - self.base] = (n, time.monotonic() + HOLD_S)

    def held(self) -> int:
        with self._lock:
            self._expire(time.monotonic())
            return sum(n for n, _ in self._held.values())

    def _expire(self, now: float) -> None:
        for off, (n, until) in list(self._held.items()):
            if until <= now:
                del self._held[off]
                self._put_back(off, n)

    def _put_back(self, off: int, n: int) -> None:
        """Return [off, off + n) to the free list, merged with its neighbours (lock held)."""
        free = self._free
        free.append((off, n))
        free.sort()
        merged: list[tuple[int, int]] = []
        for o, length in free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((o, length))
        self._free = merged
