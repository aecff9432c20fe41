"""The agent's memory for its connections, bounded per host key and in all.

What a connection holds is its request frame (up to `--max-frame`, read before it is served)
and its staging memory (`--staging`, mapped on first use and kept; quarantined staging stays
counted until NIXL says its transfer is final). Before, only the per-connection sizes were
bounded: one key with 64 connections could hold 64 x (64 MiB + 64 MiB), about 8 GiB. Now both
take bytes from `Memory`: at most `per_key` for one host key's connections and `total` for all;
a frame past it closes its connection (counted `rejected_memory`; the client reconnects, its
request a miss), staging past it sends the request's blocks back unmoved (a miss, the client
retries). Frames before a verified HELLO are not counted: at most `--max-pending` of 64 KiB.

Primitives: `Memory(total, per_key)`; `.take(owner, n)` -> None or why not; `.give(owner, n)`;
`.held(owner=None)`. Never blocks.
"""

from __future__ import annotations

import threading
from collections import Counter

MAX_MEMORY = 4 << 30          # bytes of frames and staging of all connections
MAX_MEMORY_PER_KEY = 1 << 30  # ... of one host key's connections


class Memory:
    def __init__(self, total: int = MAX_MEMORY, per_key: int = MAX_MEMORY_PER_KEY):
        self.total, self.per_key = int(total), int(per_key)
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()
        self._sum = 0

    def take(self, owner: str, n: int) -> str | None:
        with self._lock:
            if self._held[owner] + n > self.per_key:
                return (f"this host key's connections hold {self._held[owner]} bytes of frames "
                        f"and staging (--max-memory-per-key {self.per_key})")
            if self._sum + n > self.total:
                return (f"the agent's connections hold {self._sum} bytes of frames and staging "
                        f"(--max-memory {self.total})")
            self._held[owner] += n
            self._sum += n
            return None

    def give(self, owner: str, n: int) -> None:
        with self._lock:
            self._held[owner] -= n
            self._sum -= n
            if self._held[owner] <= 0:
                del self._held[owner]

    def held(self, owner: str | None = None) -> int:
        with self._lock:
            return self._sum if owner is None else self._held.get(owner, 0)
