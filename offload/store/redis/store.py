"""The Redis tier: blocks shared by every replica and kept across restarts (by Redis).

Primitives:
- Value format and MAC: `value` (a 48-byte header with a GMAC tag over the Redis key, the
  header and the block, keyed by `redis.secret_file`). Never pickle. A value that fails the
  header, length or tag check (corrupted, truncated, forged, or moved to another key) is a miss
  (`checksum_failures`): never served, so never tiered to NVMe, and never deleted (a value we
  cannot verify is not provably ours; it leaves the budget index).
- Keys: `PREFIX:v2:` + the 32-byte block key (namespace digest, salt included, + page digest),
  where PREFIX is `redis.key_prefix` (one per tenant: ACL `~PREFIX:*`); the budget index and the
  namespace records live under the same prefix. `clear()` SCANs only `PREFIX:v2:*`.
- `RedisStore(cfg)`: a `BlockStore`. Batches are pipelined (EXISTS, SET NX [EX ttl],
  GETRANGE of our length + 1 byte [+ EXPIRE for a sliding ttl], DEL), each pipeline ending with
  ECHO of a fresh token (`_execute`: a reply stream out of step drops the connection); every
  data-path call runs under one deadline and reply allowance (`link.call`, `call`). A
  value longer than ours is never read past our length + 1 (a miss, `size_mismatches`).
  Writes send the header and the caller's buffers without joining them (`link.Vectored`).
  With `max_bytes` set, an LRU index kept in Redis itself (a sorted set scored by last use in the
  server's microseconds, a size hash and a byte counter under one hash tag, updated by Lua
  scripts: `budget`) evicts our oldest blocks past the budget; blocks Redis drops by
  itself (`maxmemory` eviction, expiry) leave the index when next found missing or expired.
Lifecycle: construct (reads the secret file; no connection yet), use from any thread, `close()`.
Failures (Redis down, slow, refusing AUTH) are handled by `RedisLink`: counted, backed off,
reconnected; meanwhile every call returns misses at once.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from concurrent.futures import Future
from typing import Any, Sequence

from offload.config import RedisConfig
from offload.errors import StoreError
from offload.keys import KEY_BYTES, Namespace
from offload.secret import read_secret_file
from offload.store.base import Buffer, StoreStats, all_false, never_raises, total_len
from offload.store.redis.budget import ADD as _ADD
from offload.store.redis.budget import TOUCH as _TOUCH
from offload.store.redis.call import ProtocolError
from offload.store.redis.link import RedisLink, Vectored
from offload.store.redis.value import HEADER, ValueCodec

log = logging.getLogger("offload.store.redis.store")

FORMAT = b":v2:"                     # after the key prefix; bumped with the value format
PIPELINE_BYTES = 64 << 20  # bytes in flight per pipeline round trip
SCRIPT_LOG_EVERY_S = 60.0  # budget scripts failing in Redis are logged at most this often

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(what: str, msg: str, *args: object) -> None:
    """Log a start-up warning once per process for `what` (not once per store or bench size)."""
    with _warned_lock:
        if what in _warned:
            return
        _warned.add(what)
    log.warning(msg, *args)


def _chunks(n: int, sizes: Sequence[int]) -> list[range]:
    """Index ranges whose byte total stays under PIPELINE_BYTES (at least one item each)."""
    out, start, acc = [], 0, 0
    for i in range(n):
        if i > start and acc + sizes[i] > PIPELINE_BYTES:
            out.append(range(start, i))
            start, acc = i, 0
        acc += sizes[i]
    if start < n:
        out.append(range(start, n))
    return out


class RedisStore:
    def __init__(self, cfg: RedisConfig, link: RedisLink | None = None):
        """Raises ConfigError: a bad URL, or an unreadable / too open / too short secret file."""
        self.cfg = cfg
        secret = (read_secret_file(cfg.secret_file, "offload.redis.secret_file")
                  if cfg.secret_file else None)
        self.codec = ValueCodec(secret)
        self.link = link or RedisLink(cfg)
        if secret is None:
            _warn_once(f"{self.link.target.display()} {cfg.key_prefix}",
                       "Redis tier %s (prefix %s): offload.redis.secret_file is unset; values are "
                       "bound to their keys, but anyone who can write to this Redis can forge "
                       "blocks", self.link.target.display(), cfg.key_prefix)
        self.prefix = cfg.key_prefix.encode() + FORMAT
        self.ns_prefix = self.prefix + b"ns:"
        self.events_prefix = self.prefix + b"kvev:"    # KV-event streams (`offload.events.feeds`)
        # Budget index: one hash tag, so the three keys live on one node of a cluster.
        self.idx_prefix = self.prefix + b"{idx}:"
        self.idx_keys = [self.idx_prefix + k for k in (b"lru", b"size", b"bytes")]
        self._stats = StoreStats(capacity=int(cfg.max_bytes or 0))
        self._scripts: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._mismatches = 0
        self._script_errors = 0
        self._script_logged = -SCRIPT_LOG_EVERY_S

    def _add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self._stats, name, getattr(self._stats, name) + n)

    def rkey(self, key: bytes) -> bytes:
        return self.prefix + bytes(key)

    # -- data path --------------------------------------------------------------------------
    @never_raises("redis put", all_false)
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]) -> list[bool]:
        n = len(keys)
        with self.link.call(sum(HEADER.size + total_len(b) for b in blocks), 3 * n + 6):
            return self._put(keys, blocks)

    def _put(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]) -> list[bool]:
        n = len(keys)
        out = [False] * n
        todo = [i for i in range(n) if len(keys[i]) == KEY_BYTES]
        present = self._exists([keys[i] for i in todo]) if todo else []
        if present is None:
            self._add(put_skipped=n)
            return out
        missing = []
        for i, p in zip(todo, present):
            if p:
                out[i] = True
            else:
                missing.append(i)
        views = {i: [memoryview(b).cast("B") for b in blocks[i]] for i in missing}
        sizes = [sum(v.nbytes for v in views[i]) for i in missing]
        budget = self.cfg.max_bytes
        written: list[tuple[bytes, int]] = []
        # MACs are computed ahead on the codec's threads (the MAC releases the GIL), so the tags
        # of the next pipeline are ready while this one is on the wire.
        seals = {i: self.codec.seal_async(self.rkey(keys[i]), views[i]) for i in missing}
        for rng in _chunks(len(missing), sizes):
            idx = [missing[j] for j in rng]
            if budget is not None:
                idx = [i for i in idx if sum(v.nbytes for v in views[i]) <= budget]

            def send(c: Any, idx: list[int] = idx) -> list[Any]:
                pipe = c.pipeline(transaction=False)
                for i in idx:
                    pipe.set(self.rkey(keys[i]), Vectored([seals[i].result(), *views[i]]),
                             nx=True, ex=self.cfg.ttl_s)
                got = self._execute(pipe, len(idx))
                if not all(r is None or isinstance(r, (bool, Exception)) for r in got):
                    raise ProtocolError("a SET NX reply that is neither OK nor nil")
                return got

            res = self.link.run(send, "put")
            if res is None:
                break
            for i, r in zip(idx, res):
                if isinstance(r, Exception):
                    log.warning("Redis refused a block (%s)", r)
                    continue
                out[i] = True
                if r:  # None: another replica stored it first
                    size = sum(v.nbytes for v in views[i])
                    written.append((self.rkey(keys[i]), size))
                    self._add(puts=1, bytes_written=size)
        self._add(put_skipped=out.count(False))
        if budget is not None and written:
            victims = set(self._budget_add(written))
            for i in missing:
                if out[i] and self.rkey(keys[i]) in victims:
                    out[i] = False
        return out

    @never_raises("redis get", all_false)
    def get_many(self, keys: Sequence[bytes], dests: Sequence[Sequence[Buffer]]) -> list[bool]:
        n = len(keys)
        want = [HEADER.size + total_len(d) for d in dests]     # the value length we wrote
        with self.link.call(sum(want), 2 * n + 4):
            return self._get(keys, dests, want)

    def _get(self, keys: Sequence[bytes], dests: Sequence[Sequence[Buffer]],
             want: list[int]) -> list[bool]:
        n = len(keys)
        out = [False] * n
        values: list[Any] = [None] * n
        opened: dict[int, Future[memoryview | None]] = {}
        step = 2 if self.cfg.ttl_s else 1
        for rng in _chunks(n, want):
            def fetch(c: Any, rng: range = rng) -> list[Any]:
                pipe = c.pipeline(transaction=False)
                for i in rng:         # one byte past our length: a longer value shows, unread
                    pipe.getrange(self.rkey(keys[i]), 0, want[i])
                    if self.cfg.ttl_s:
                        pipe.expire(self.rkey(keys[i]), self.cfg.ttl_s)
                got = self._execute(pipe, step * len(rng))[::step]
                if not all(isinstance(v, (bytes, Exception)) for v in got):
                    raise ProtocolError("a GETRANGE reply that is not a string")
                return got

            res = self.link.run(fetch, "get")
            if res is None:
                break
            for i, v in zip(rng, res):     # checked on the codec's threads while the next
                values[i] = v              # pipeline is fetched
                if isinstance(v, bytes) and 0 < len(v) <= want[i]:
                    opened[i] = self.codec.open_async(self.rkey(keys[i]), v)
        corrupt, gone, hits = [], [], []
        mismatches = 0
        for i, v in enumerate(values):
            if not isinstance(v, bytes):   # not fetched, or not a string (WRONGTYPE)
                continue
            if not v:                      # no such key (or an empty value: not ours)
                gone.append(self.rkey(keys[i]))
                continue
            if i not in opened:            # longer than we wrote: the rest was never read
                mismatches += 1
                continue
            body = opened[i].result()
            if body is None:
                corrupt.append(self.rkey(keys[i]))
                continue
            if body.nbytes != want[i] - HEADER.size:
                mismatches += 1            # ours, another size (the caller's buffers differ)
                continue
            pos = 0
            for b in dests[i]:
                mv = memoryview(b).cast("B")
                mv[:] = body[pos:pos + mv.nbytes]
                pos += mv.nbytes
            out[i] = True
            hits.append(self.rkey(keys[i]))
            self._add(bytes_read=body.nbytes)
        if mismatches:
            with self._lock:
                self._mismatches += mismatches
        if corrupt:
            # Never deleted: a value we cannot verify is not provably ours (another writer's, a
            # reply out of step, another secret_file); it is a miss and leaves our budget index.
            self._add(checksum_failures=len(corrupt))
            log.warning("%d value(s) in Redis failed the header, length or MAC check (corrupt, "
                        "truncated, forged, moved between keys, or written with another "
                        "secret_file under the same key_prefix): misses, left in place",
                        len(corrupt))
            gone += corrupt
        if self.cfg.max_bytes is not None:
            if hits:
                self._script("touch", _TOUCH, [b"touch", *hits])
            if gone:
                self._script("touch", _TOUCH, [b"forget", *gone])
        self._add(hits=len(hits), misses=n - len(hits))
        return out

    @never_raises("redis exists", all_false)
    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self.link.call(0, len(keys) + 1):
            res = self._exists(keys)
        return [False] * len(keys) if res is None else res

    def _exists(self, keys: Sequence[bytes]) -> list[bool] | None:
        def check(c: Any) -> list[Any]:
            pipe = c.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self.rkey(k))
            got = self._execute(pipe, len(keys))
            if not all(isinstance(r, (int, Exception)) for r in got):
                raise ProtocolError("an EXISTS reply that is not an integer")
            return got

        res = self.link.run(check, "exists")
        return None if res is None else [isinstance(r, int) and r > 0 for r in res]

    @never_raises("redis delete", lambda *_a, **_k: 0)
    def delete_many(self, keys: Sequence[bytes]) -> int:
        rkeys = [self.rkey(k) for k in keys]
        with self.link.call(0, len(rkeys) + 2):
            n = self._delete_raw(rkeys)
            if self.cfg.max_bytes is not None and rkeys:
                self._script("touch", _TOUCH, [b"forget", *rkeys])
        return n

    def clear(self, namespace: bytes | None = None) -> int:
        """Delete our blocks (all, or one namespace's) with SCAN: never KEYS, never FLUSHDB.

        Only keys under this store's `key_prefix` are matched: other tenants' keys are never
        deleted (and, with the ACL recipe in docs/deploy/redis.md, could not be). The SCAN pages
        are names anyone who can write our keys can plant (a 65 MiB name is past a control
        call's reply bound): they are read on a link of their own, so a page that fails backs
        off this clear alone, never the data path's breaker (SGLang's clear-storage call runs
        here, in the serving process)."""
        prefix = self.prefix + (bytes(namespace) if namespace else b"")
        pattern = re.sub(rb"([*?\[\]\\])", rb"\\\1", prefix) + b"*"

        found: list[bytes] = []
        cursor = 0
        scan_link = RedisLink(self.cfg)
        try:
            while True:                    # one bounded call per SCAN page
                def scan(c: Any, cur: int = cursor) -> tuple[int, list[bytes]]:
                    return c.scan(cur, match=pattern, count=1000)  # type: ignore[no-any-return]

                page = scan_link.run(scan, "clear")
                if page is None:
                    break
                cursor, names = page
                found += [k for k in names if not k.startswith((self.ns_prefix, self.idx_prefix,
                                                                self.events_prefix))]
                if not cursor:
                    break
        finally:
            scan_link.close()
        n = 0
        for i in range(0, len(found), 1000):
            n += self._delete_raw(found[i:i + 1000])
            if self.cfg.max_bytes is not None:
                self._script("touch", _TOUCH, [b"forget", *found[i:i + 1000]])
        return n

    def _delete_raw(self, rkeys: Sequence[bytes]) -> int:
        def delete(c: Any) -> list[Any]:
            pipe = c.pipeline(transaction=False)
            for k in rkeys:
                pipe.delete(k)
            return self._execute(pipe, len(rkeys))

        res = self.link.run(delete, "delete") if rkeys else []
        return sum(r for r in res or [] if isinstance(r, int))

    def _execute(self, pipe: Any, n: int) -> list[Any]:
        """The replies of a pipeline of `n` commands, or ProtocolError if the reply stream is out
        of step (the link then drops the connection, so the next call starts in step).

        On a standalone server the pipeline ends with ECHO of a fresh token: an extra reply
        anywhere before it, or a missing one, moves the token out of its place. (A cluster
        pipeline is split per node by redis-py; there the reply count is checked.)"""
        token = None if self.link.target.cluster else os.urandom(8).hex().encode()
        if token is not None:
            pipe.echo(token)
        res: list[Any] = pipe.execute(raise_on_error=False)
        if token is not None and len(res) == n + 1 and isinstance(res[-1], Exception):
            raise ProtocolError(f"Redis refused ECHO ({res[-1]}); the tier needs it: an ACL "
                                "user needs +echo (docs/deploy/redis.md)")
        if len(res) != n + (token is not None) or (token is not None and res[-1] != token):
            raise ProtocolError(f"the reply stream is out of step ({len(res)} replies to "
                                f"{n + (token is not None)} commands, or a moved ECHO token)")
        return res[:n]

    # -- budget index -----------------------------------------------------------------------
    def _script(self, name: str, src: str, args: Sequence[Any]) -> Any:
        """A budget script's reply, or None. A script Redis refuses or fails (an index record
        another writer of our keys broke: a key of another type; `NOPERM`) is counted in
        `script_errors` and logged at most once per `SCRIPT_LOG_EVERY_S`; it is not a failure
        of the link (Redis answered), so the data path's breaker does not trip."""
        from redis.exceptions import NoScriptError, ResponseError

        def call(c: Any) -> Any:
            if name not in self._scripts:
                self._scripts[name] = c.register_script(src)
            try:
                return self._scripts[name](keys=self.idx_keys, args=list(args), client=c)
            except NoScriptError:
                raise
            except ResponseError as e:
                self._script_error(name, e)
                return None

        return self.link.run(call, f"budget {name}")

    def _script_error(self, name: str, e: Exception) -> None:
        now = time.monotonic()
        with self._lock:
            self._script_errors += 1
            quiet = now - self._script_logged < SCRIPT_LOG_EVERY_S
            if not quiet:
                self._script_logged = now
        if not quiet:
            log.warning("Redis tier %s: the budget script %s failed in Redis (%s); the max_bytes "
                        "index under %s may have been changed by another writer (logged at most "
                        "every %g s)", self.link.target.display(), name,
                        str(e)[:200], self.idx_prefix.decode(errors="replace"),
                        SCRIPT_LOG_EVERY_S)

    def _budget_add(self, written: list[tuple[bytes, int]]) -> list[bytes]:
        ttl_us = int(self.cfg.ttl_s or 0) * 1_000_000
        args: list[Any] = [int(self.cfg.max_bytes or 0), ttl_us, self.prefix, KEY_BYTES]
        for rk, size in written:
            args += [rk, size]
        victims = self._script("add", _ADD, args) or []
        if victims:
            self._delete_raw(victims)
            self._add(evictions=len(victims))
        return [bytes(v) for v in victims]

    # -- control path -----------------------------------------------------------------------
    def register_namespace(self, ns: Namespace) -> None:
        doc = json.dumps(ns.describe(), sort_keys=True).encode()
        self.link.run(lambda c: c.set(self.ns_prefix + ns.digest().hex().encode(), doc),
                      "register_namespace")

    def ping(self) -> None:
        """Control path: StoreError unless Redis answers, in step (ECHO: `_execute`)."""
        self.link.ping()
        if self.link.run(lambda c: self._execute(c.pipeline(transaction=False), 0), "ping") is None:
            raise StoreError(f"Redis tier {self.link.target.display()} is not usable: "
                             f"{self.link.last_error}")

    def tier_stats(self) -> dict[str, StoreStats]:
        return {"redis": self.stats()}

    def stats(self) -> StoreStats:
        with self._lock:
            s = StoreStats(**vars(self._stats))
            mismatches = self._mismatches
        s.extra = dict(self.link.counters(), size_mismatches=mismatches,
                       script_errors=self._script_errors,
                       key_prefix=self.cfg.key_prefix, authenticated=self.codec.authenticated)
        if self.cfg.max_bytes is not None and self.link.available():
            def read(c: Any) -> list[Any]:
                pipe = c.pipeline(transaction=False)
                pipe.zcard(self.idx_keys[0])
                pipe.getrange(self.idx_keys[2], 0, 20)     # a counter: at most 21 bytes read
                return self._execute(pipe, 2)

            with self.link.call(0, 3):
                res = self.link.run(read, "stats")
            if res and isinstance(res[0], int) and isinstance(res[1], bytes):
                try:
                    s.blocks, s.bytes_used = res[0], int(res[1] or 0)
                except ValueError:      # not a number (another writer's): unknown, left at 0
                    pass
        return s

    def close(self) -> None:
        self.link.close()
