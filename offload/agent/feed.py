"""The agent's announcement feed: which SGLang block hash each stored block holds, per namespace.

The agent's store knows blocks by key only, so replicas sharing the agent cannot name each
other's pages in their KV events (`offload.events`). Each host announces the pages it stored
once they are durable (ANNOUNCE: block key, block hash, parent hash); the agent keeps them per
namespace with a sequence number, and any host entitled to the namespace reads them in order
(FEED: the pages after a cursor, at most `protocol.MAX_KEYS` per request). This is the agent's
twin of the Redis tier's announcement stream.

Primitives: `Feeds(per_tenant, memory=)`; `.announce(tenant, pages)` -> per page, recorded (the
caller has checked that the host may use the keys' namespaces and that the store holds each
block durably: only such pages are given); `.read(ns, after, limit)` -> (pages, next cursor, oldest
sequence kept); `.forget(keys)` (a DELETE); `.epoch` (random per agent start: a reader whose
cursor came from another epoch starts again at 0).

Bounded per host key (tenant, `Access.tenant`): at most `per_tenant` pages announced by one
tenant are kept; past that its own oldest are forgotten, never another tenant's. The count is
the tenant's book (`_owned[tenant]`), the one place a page is counted: a page announced again
moves to the end of its feed and of the announcing tenant's book (before, re-announcing a page
that was the last of a book detached the book being filled, and the pages after it were
counted nowhere: 147,421 kept against the cap of 100,000). Memory: 474 bytes a page
(tracemalloc over 100,000 pages, 2026-12-02), 47 MB at the cap; each page kept is charged
`PAGE_BYTES` to its tenant in the agent's memory budget (`offload.agent.budget`) before it is
recorded, and given back when it is forgotten (a page past the budget is not recorded).
Thread-safe; no I/O.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple, Sequence

from offload.keys import NS_BYTES

if TYPE_CHECKING:
    from offload.agent.budget import Memory

PER_TENANT = 100_000        # pages announced by one host key kept (like the Redis stream's cap)
PAGE_BYTES = 512            # charged per page kept (474 measured)
EPOCH_BYTES = 8


class Page(NamedTuple):
    key: bytes
    hash: int
    parent: int | None


class _Entry(NamedTuple):
    seq: int
    hash: int
    parent: int | None
    tenant: str


class _Feed:
    """One namespace: its pages by key, and (seq, key) in sequence order (stale ones skipped)."""

    def __init__(self) -> None:
        self.pages: dict[bytes, _Entry] = {}
        self.log: list[tuple[int, bytes]] = []

    def live(self, seq: int, key: bytes) -> bool:
        e = self.pages.get(key)
        return e is not None and e.seq == seq

    def compact(self) -> None:
        if len(self.log) > 2 * len(self.pages) + 1024:
            self.log = [(s, k) for s, k in self.log if self.live(s, k)]


class Feeds:
    def __init__(self, per_tenant: int = PER_TENANT, memory: "Memory | None" = None):
        self.per_tenant = per_tenant
        self._memory = memory
        self.epoch = os.urandom(EPOCH_BYTES)
        self._lock = threading.Lock()
        self._seq = 0
        self._feeds: dict[bytes, _Feed] = {}
        self._owned: dict[str, OrderedDict[bytes, None]] = {}   # tenant -> its keys, oldest first

    def announce(self, tenant: str, pages: Sequence[Page]) -> list[bool]:
        """Record `pages` for `tenant` (checked by the caller); per page, recorded (False: past
        the tenant's memory budget)."""
        out = []
        with self._lock:
            for p in pages:
                key = bytes(p.key)
                self._drop(key)
                if self._memory is not None and self._memory.take(tenant, PAGE_BYTES):
                    out.append(False)
                    continue
                self._seq += 1
                feed = self._feeds.setdefault(key[:NS_BYTES], _Feed())
                feed.pages[key] = _Entry(self._seq, p.hash, p.parent, tenant)
                feed.log.append((self._seq, key))
                mine = self._owned.setdefault(tenant, OrderedDict())    # after the drop: the
                mine[key] = None                                        # book it may have emptied
                while len(mine) > self.per_tenant:
                    self._drop(next(iter(mine)))
                out.append(True)
            return out

    def held(self, tenant: str) -> int:
        """Pages `tenant`'s book keeps."""
        with self._lock:
            return len(self._owned.get(tenant, ()))

    def _drop(self, key: bytes) -> None:
        """Forget one page (lock held)."""
        feed = self._feeds.get(key[:NS_BYTES])
        e = feed.pages.pop(key, None) if feed is not None else None
        if feed is None or e is None:
            return
        owned = self._owned.get(e.tenant)
        if owned is not None:
            owned.pop(key, None)
            if not owned:
                del self._owned[e.tenant]
        if self._memory is not None:
            self._memory.give(e.tenant, PAGE_BYTES)
        if not feed.pages:
            del self._feeds[key[:NS_BYTES]]
        else:
            feed.compact()

    def forget(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._drop(bytes(k))

    def read(self, ns: bytes, after: int, limit: int) -> tuple[list[Page], int, int]:
        """The pages of namespace `ns` announced after sequence `after`, oldest first, at most
        `limit`: (pages, the cursor to read on from, the oldest sequence `ns` still keeps; 0
        when it keeps none)."""
        with self._lock:
            feed = self._feeds.get(bytes(ns))
            if feed is None:
                return [], max(after, 0), 0
            head = 0                  # stale entries at the head go (amortised)
            while not feed.live(*feed.log[head]):
                head += 1
            del feed.log[:head]
            out: list[Page] = []
            nxt = after
            i = bisect.bisect_right(feed.log, (after, b"\xff" * 64))
            while i < len(feed.log) and len(out) < limit:
                seq, key = feed.log[i]
                i += 1
                nxt = seq
                if feed.live(seq, key):
                    e = feed.pages[key]
                    out.append(Page(key, e.hash, e.parent))
            return out, nxt, feed.log[0][0]

    def size(self) -> int:
        """Pages kept, in all (STATS)."""
        with self._lock:
            return sum(len(f.pages) for f in self._feeds.values())
