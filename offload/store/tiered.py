"""Two stores as one: a local tier (NVMe, DRAM) in front of a shared tier (Redis).

Primitives:
- `WritePolicy`: decides which blocks go to the shared tier. `WriteThrough` (all of them) and
  `SeenN(n)` (a block seen n times: stored, or read from the local tier), `policy_from_config`.
- `TieredStore(local, shared, policy)`: a `BlockStore`.
  get: local first; the misses from the shared tier, and a shared hit is promoted (written) into
  the local tier. put: local, and shared for the blocks the policy admits (synchronously: the
  caller's buffers are only valid during the call). A local hit on a block the policy admits but
  that is not known to be in the shared tier (written while Redis was down, or under `seen_n`
  before its n-th sighting) is copied and uploaded by one background thread, through a bounded
  queue (dropped, counted, when full). exists: local, then shared for the rest.
- `make_tiered(local, redis_cfg)`: the local store alone when no Redis URL is set, else the pair.
The shared tier's failures never fail a call: it returns misses, and the local tier serves.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from typing import Protocol, Sequence

from offload.config import RedisConfig
from offload.keys import Namespace
from offload.store.base import (
    Backlog,
    BlockStore,
    Buffer,
    Flushable,
    HasBacklog,
    RegistersRegions,
    StoreStats,
    never_raises,
    promote,
    total_len,
)

log = logging.getLogger("offload.store.tiered")


class WritePolicy(Protocol):
    def admit(self, key: bytes) -> bool:
        """Count one sighting of `key`; True if the block belongs in the shared tier."""
        ...


class WriteThrough:
    def admit(self, key: bytes) -> bool:
        return True


class SeenN:
    """Admit a block on its n-th sighting; counts are kept for the `max_tracked` latest keys."""

    def __init__(self, n: int, max_tracked: int = 1 << 18):
        self.n = n
        self.max_tracked = max_tracked
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()

    def admit(self, key: bytes) -> bool:
        with self._lock:
            c = self._seen.pop(key, 0) + 1
            self._seen[key] = c
            if len(self._seen) > self.max_tracked:
                self._seen.popitem(last=False)
            return c >= self.n


def policy_from_config(cfg: RedisConfig) -> WritePolicy:
    return WriteThrough() if cfg.write_policy == "write_through" else SeenN(cfg.seen_n)


class _KeySet:
    """A bounded set of recently confirmed keys (those known to be in the shared tier)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._d: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, key: bytes) -> None:
        with self._lock:
            self._d[key] = None
            self._d.move_to_end(key)
            if len(self._d) > self.limit:
                self._d.popitem(last=False)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._d

    def discard(self, key: bytes) -> None:
        with self._lock:
            self._d.pop(key, None)


class TieredStore:
    def __init__(self, local: BlockStore, shared: BlockStore, policy: WritePolicy,
                 *, upload_queue_bytes: int = 256 << 20, known_keys: int = 1 << 18):
        self.local = local
        self.shared = shared
        self.policy = policy
        self._known = _KeySet(known_keys)
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue()
        self._queued_bytes = self._queued_pages = 0     # queued or being uploaded
        self._queue_limit = upload_queue_bytes
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.counters = {"local_hits": 0, "shared_hits": 0, "misses": 0, "promotions": 0,
                         "promotion_failures": 0, "shared_writes": 0, "shared_write_failures": 0,
                         "uploads_queued": 0, "uploads_dropped": 0}

    def parts(self) -> Sequence[BlockStore]:
        """The local tier, then the shared one (`offload.store.base.Composite`)."""
        return [self.local, self.shared]

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    # -- data path --------------------------------------------------------------------------
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]) -> list[bool]:
        out = list(self.local.put_many(keys, blocks))
        share = [i for i, k in enumerate(keys) if self.policy.admit(k) and k not in self._known]
        if share:
            res = self.shared.put_many([keys[i] for i in share], [blocks[i] for i in share])
            for i, ok in zip(share, res):
                if ok:
                    self._known.add(keys[i])
                    out[i] = True
            self._count("shared_writes", sum(res))
            self._count("shared_write_failures", len(share) - sum(res))
        return out

    def get_many(self, keys: Sequence[bytes], dests: Sequence[Sequence[Buffer]]) -> list[bool]:
        out = list(self.local.get_many(keys, dests))
        hits = [i for i, ok in enumerate(out) if ok]
        self._count("local_hits", len(hits))
        for i in hits:
            if keys[i] not in self._known and self.policy.admit(keys[i]):
                self._enqueue(keys[i], dests[i])
        miss = [i for i, ok in enumerate(out) if not ok]
        if not miss:
            return out
        res = self.shared.get_many([keys[i] for i in miss], [dests[i] for i in miss])
        found = [i for i, ok in zip(miss, res) if ok]
        for i in found:
            out[i] = True
            self._known.add(keys[i])
        self._count("shared_hits", len(found))
        self._count("misses", len(miss) - len(found))
        if found:
            # on the get's path: a local store that can, waits no longer than a read does
            prom = promote(self.local, [keys[i] for i in found], [dests[i] for i in found])
            self._count("promotions", sum(prom))
            self._count("promotion_failures", len(found) - sum(prom))
        return out

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        out = list(self.local.exists_many(keys))
        rest = [i for i, ok in enumerate(out) if not ok]
        if rest:
            for i, ok in zip(rest, self.shared.exists_many([keys[i] for i in rest])):
                out[i] = ok
        return out

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Deletes from both tiers (the shared copy too); returns how many of `keys` either
        tier held (a block in both is one block)."""
        for k in keys:
            self._known.discard(k)
        held = [a or b for a, b in zip(self.local.exists_many(keys),
                                       self.shared.exists_many(keys))]
        n_local, n_shared = self.local.delete_many(keys), self.shared.delete_many(keys)
        return max(sum(held), n_local, n_shared)

    # -- background uploads of local hits -------------------------------------------------------
    def _enqueue(self, key: bytes, bufs: Sequence[Buffer]) -> None:
        size = total_len(bufs)
        with self._lock:
            if self._queued_bytes + size > self._queue_limit:
                self.counters["uploads_dropped"] += 1
                return
            self._queued_bytes += size
            self._queued_pages += 1
            self.counters["uploads_queued"] += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._upload_loop, daemon=True,
                                                name="offload-tier-upload")
                self._thread.start()
        self._known.add(key)  # one try per key: a failed upload is not repeated on every hit
        data = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
        self._queue.put((key, data))

    def _upload_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                ok = self._upload(*item)
                self._count("shared_writes" if ok else "shared_write_failures")
            finally:  # the bytes leave the budget whatever happened, or every later upload drops
                if item is not None:
                    with self._lock:
                        self._queued_bytes -= len(item[1])
                        self._queued_pages -= 1
                self._queue.task_done()

    def backlog(self) -> dict[str, Backlog]:
        """The uploads queued for the shared tier (`redis`) and not yet done, with the local
        tier's own backlog if it has one (the write-through puts are synchronous: never here)."""
        with self._lock:
            own = Backlog(self._queued_pages, self._queued_bytes)
        local = self.local.backlog() if isinstance(self.local, HasBacklog) else {}
        return {**local, "redis": own}

    @never_raises("upload to the shared tier", lambda *_a, **_k: False)
    def _upload(self, key: bytes, data: bytes) -> bool:
        return bool(self.shared.put_many([key], [[data]])[0])

    def flush(self) -> bool:
        """Wait until every queued upload has been tried and the local tier's puts are durable
        (tests, shutdown). False if the local tier lost a block since its last flush."""
        if self._thread is not None:
            self._queue.join()
        return not isinstance(self.local, Flushable) or self.local.flush() is not False

    # -- control path -----------------------------------------------------------------------
    def clear(self, namespace: bytes | None = None) -> int:
        """Clear both tiers (the shared tier for every replica: an admin action); returns the
        larger tier's count (a block in both is one block; the shared tier holds most)."""
        return max(self.local.clear(namespace), self.shared.clear(namespace))

    def register_region(self, buffer: object) -> None:
        """Memory the local path moves pages in and out of (NIXL registration on the dpu path)."""
        if isinstance(self.local, RegistersRegions):
            self.local.register_region(buffer)

    def register_namespace(self, ns: Namespace) -> None:
        self.local.register_namespace(ns)
        self.shared.register_namespace(ns)

    def tier_stats(self) -> dict[str, StoreStats]:
        """Each part's tiers. A local tier whose counters are not this process's own (a shared
        agent's: `process_counters` in its extra) gets this store's own hits and misses of it."""
        out = dict(self.local.tier_stats())
        with self._lock:
            c = dict(self.counters)
        for s in out.values():
            if "process_counters" in s.extra:
                s.hits, s.misses = c["local_hits"], c["shared_hits"] + c["misses"]
                s.extra = {"process_counters": ("hits", "misses")}
        out.update(self.shared.tier_stats())
        return out

    def stats(self) -> StoreStats:
        loc, sh = self.local.stats(), self.shared.stats()
        s = StoreStats(**vars(loc))
        with self._lock:
            c = dict(self.counters)
        s.hits = c["local_hits"] + c["shared_hits"]
        s.misses = c["misses"]
        s.checksum_failures = loc.checksum_failures + sh.checksum_failures
        s.extra = dict(loc.extra, tiers=c, local=_plain(loc), shared=_plain(sh))
        return s

    def close(self) -> None:
        if self._thread is not None:
            self.flush()
            self._queue.put(None)
            self._thread.join(5)
        self.local.close()
        self.shared.close()


def _plain(s: StoreStats) -> dict[str, object]:
    return dict(vars(s))


def make_tiered(local: BlockStore, cfg: RedisConfig) -> BlockStore:
    """The store the backend uses: `local` alone without a Redis URL, else local + Redis."""
    if not cfg.url:
        return local
    from offload.store.redis.store import RedisStore

    return TieredStore(local, RedisStore(cfg), policy_from_config(cfg))
