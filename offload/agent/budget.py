"""The agent's memory for its host keys, bounded per host key and in all: the one enforcement
point of "every byte the agent holds on a key's behalf is charged to that key before it is
allocated, and given back only when it is free".

What is charged, each before it is allocated: a request frame with room for an ERROR reply
(`Session._admit_frame`, before its body is read), what its meta decodes to
(`protocol.bounds.decoded_bound`, before it is decoded: up to 21 times the meta), its transfers'
descriptor lists and the rest of its reply's bound once it is decoded (`protocol.bounds.work_bound`,
`protocol.bounds.reply_bound`: an inline GET's blocks), all given back once the reply is written to
the socket; a connection's staging memory (`--staging`, mapped on first use
and kept; quarantined staging stays charged until NIXL says its transfer is final); the NIXL
metadata a connection loaded (`vet.HELD_PER_BYTE` a byte: NIXL's remote agent;
`endpoint.Endpoint.load`, given back when the connection closes or loads newer); each page
of the key's announcement book (`feed.PAGE_BYTES`, given back when forgotten). Before, replies
were not charged: 16 inline GETs never read held ~250 MiB against a 64 MiB budget. Past a bound:
a frame closes its connection (counted `rejected_memory`; the client reconnects, its request a
miss), a reply gets an ERROR reply instead, staging sends the request's blocks back unmoved, a
page is not recorded. Frames before a verified HELLO are not counted: at most `--max-pending`
of 64 KiB. Store slots held by late transfers are bounded by `--max-quarantine`.

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
