"""Announcement feeds of the shared tiers: how replicas name each other's pages.

A shared tier's store knows blocks by key only; the feed carries (block key, block hash, parent
hash) from the replica that stored a page to every replica of the namespace. `Feed.publish(rows)`
(pages durable in the tier) -> per row, published; `Feed.read()` -> the next rows announced by
anyone (this replica too), at most `PER_POLL`, each checked by the caller against the tier.

- `RedisFeed(redis_store, digest)`: a capped Redis stream
  `<key_prefix><format>kvev:<namespace digest>` (fields `k` block key, `h` hash, `p` parent;
  about `STREAM_MAX` entries kept), read from its start by every replica.
- `AgentFeed(agent_store, digest)`: the agent's feed (ANNOUNCE / FEED, `offload.agent.feed`),
  kept per namespace by the agent (at most 100,000 pages per host key), read from its start; a
  restarted agent (a new epoch) is read again from its start.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, Sequence

from offload.events.chain import Row

log = logging.getLogger(__name__)

STREAM_MAX = 100_000           # entries kept on a Redis announcement stream (approximate cap)
PER_POLL = 2_000               # feed entries read per poll


class Feed(Protocol):
    def publish(self, rows: Sequence[Row]) -> list[bool]:
        """Announce pages durable in the tier; per row, whether it was."""
        ...

    def read(self) -> list[Row]:
        """The next announced rows (anyone's), at most `PER_POLL`."""
        ...


class RedisFeed:
    def __init__(self, redis_store: Any, digest: bytes):
        self.store = redis_store
        self.stream = bytes(redis_store.prefix) + b"kvev:" + digest.hex().encode()
        self._last = b"0-0"

    def _run(self, fn: Any, what: str) -> Any:
        return self.store.link.run(fn, what)

    def publish(self, rows: Sequence[Row]) -> list[bool]:
        def add(c: Any) -> Any:
            p = c.pipeline(transaction=False)
            for r in rows:
                p.xadd(self.stream, {b"k": r.key, b"h": str(r.hash),
                                     b"p": "" if r.parent is None else str(r.parent)},
                       maxlen=STREAM_MAX, approximate=True)
            return p.execute()
        self._run(add, "kv events announce")
        return [True] * len(rows)

    def read(self) -> list[Row]:
        got = self._run(lambda c: c.xread({self.stream: self._last}, count=PER_POLL),
                        "kv events read")
        rows: list[Row] = []
        for _name, entries in got or []:
            for entry_id, fields in entries:
                self._last = entry_id
                try:
                    p = fields.get(b"p", b"")
                    rows.append(Row(bytes(fields[b"k"]), int(fields[b"h"]),
                                    int(p) if p else None))
                except (KeyError, ValueError):
                    log.warning("offload events: a malformed entry %r on %r: skipped", entry_id,
                                self.stream)
        return rows


class AgentFeed:
    def __init__(self, agent_store: Any, digest: bytes):
        self.store, self.digest = agent_store, digest
        self._after = 0
        self._epoch: bytes | None = None

    def publish(self, rows: Sequence[Row]) -> list[bool]:
        return list(self.store.announce([(r.key, r.hash, r.parent) for r in rows]))

    def read(self) -> list[Row]:
        page = self.store.feed(self.digest, self._after, PER_POLL)
        if page is not None and page.epoch != self._epoch:
            restarted, self._epoch = self._epoch is not None, page.epoch
            if restarted and self._after:        # its sequences restarted: read from the start
                self._after = 0
                page = self.store.feed(self.digest, 0, PER_POLL)
        if page is None:
            return []
        self._after = max(self._after, page.next)
        return [Row(bytes(k), h, p) for k, h, p in page.pages
                if bytes(k)[:len(self.digest)] == self.digest]
