"""KV events for L3: SGLang's `BlockStored` / `BlockRemoved` with medium `DISK` or `EXTERNAL`.

SGLang 0.5.23 publishes KV-cache events (`--kv-events-config`) for `GPU` and `CPU_PINNED` only;
this package makes the HiCache backend publish the L3 tier too, through the hook of
patches/0016 (`OffloadStorage.take_kv_events`). Modules:
- `chain`: pages as rows (block key, SGLang's block hash, parent hash) and rows as SGLang events;
- `ledger`: the directory's `kv-events.db` (block key -> hash), shared by its processes;
- `sources`: what each tier tells (the disk index's change log; for the shared tiers, their
  announcement feed and a sweep);
- `feeds`: the shared tiers' announcement feeds (a Redis stream, the agent's ANNOUNCE / FEED);
- `tracker`: `L3Events`, the queue SGLang takes from, fed by one thread.

`open_events(store, digest, page_size, make_keys, split)` builds the tracker for a backend's store: `DISK`
for a local `DiskStore` (also under a transfer path or a tiered store), `EXTERNAL` for the Redis
tier and for the agent, found on `offload.store.base.walk(store)` (the store's declared parts).
Message shapes and an example subscriber: docs/reference/events.md.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from offload.events.feeds import AgentFeed, RedisFeed
from offload.events.sources import DISK, EXTERNAL, DiskSource, SharedSource, Source
from offload.events.tracker import L3Events
from offload.store.base import BlockStore, walk

log = logging.getLogger(__name__)


def sources_for(store: BlockStore, digest: bytes) -> list[Source]:
    """One source per tier the store is made of (`offload.store.base.walk`: the parts of a
    transfer path, a tiered store, a spread store's drives), outermost first."""
    from offload.agent.client import AgentStore
    from offload.store.disk.store import DiskStore
    from offload.store.redis.store import RedisStore

    found: list[Source] = []
    for part in walk(store):
        if isinstance(part, DiskStore):
            found.append(DiskSource(part.directory, digest))
        elif isinstance(part, RedisStore):
            # A store of its own (connection, breaker, counters): nothing the events do (the
            # stream another writer fills, EXISTS checks, sweeps) touches the data path's.
            own = RedisStore(part.cfg)
            found.append(SharedSource(own, RedisFeed(own, digest, link=own.link)))
        elif isinstance(part, AgentStore):
            found.append(SharedSource(part, AgentFeed(part, digest)))
    return found


def open_events(store: BlockStore, digest: bytes, page_size: int,
                make_keys: Callable[[Sequence[str]], list[bytes]], split: int = 1
                ) -> L3Events | None:
    """The tracker of a backend's L3 events, or None when no tier of the store has any (an
    in-memory store). Control path: a ledger that cannot be opened raises OSError/sqlite3.Error."""
    sources = sources_for(store, digest)
    if not sources:
        return None
    log.info("offload: KV events for L3: %s", ", ".join(
        f"{type(s).__name__} ({s.medium})" for s in sources))
    return L3Events(sources, page_size, make_keys, split)


__all__ = ["DISK", "EXTERNAL", "L3Events", "open_events", "sources_for"]
