"""Announcement feeds of the shared tiers: how replicas name each other's pages.

A shared tier's store knows blocks by key only; the feed carries (block key, block hash, parent
hash) from the replica that stored a page to every replica of the namespace. `Feed.publish(rows)`
(pages durable in the tier) -> per row, published; `Feed.read()` -> the next rows announced by
anyone (this replica too), at most `PER_POLL`, each checked by the caller against the tier.

- `RedisFeed(redis_store, digest)`: a capped Redis stream
  `<key_prefix><format>kvev:<namespace digest>` (fields `k` block key, `h` hash, `p` parent;
  about `STREAM_MAX` entries kept), read from its start by every replica, on its own
  connection, each entry under a bound (`ENTRY_BYTES`); what fails a check is skipped.
- `AgentFeed(agent_store, digest)`: the agent's feed (ANNOUNCE / FEED, `offload.agent.feed`),
  kept per namespace by the agent (at most 100,000 pages per host key), read from its start; a
  restarted agent (a new epoch) is read again from its start.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol, Sequence

from offload.events.chain import Row
from offload.keys import KEY_BYTES

log = logging.getLogger(__name__)

STREAM_MAX = 100_000           # entries kept on a Redis announcement stream (approximate cap)
PER_POLL = 2_000               # feed entries read per poll
ENTRY_BYTES = 1_024            # the most one Redis stream entry read may hold (ours: under 100)
ENTRY_FIELDS = 3               # fields of an entry (k, h, p)
STREAM_BYTES = 16 << 20        # the most a stream may hold to be read (ours: ~7 MB at STREAM_MAX)
FUTURE_MS = 3_600_000          # an entry id this far past the server's clock is not ours
LOG_EVERY_S = 60.0             # skipped entries are logged at most this often, per feed


class Feed(Protocol):
    def publish(self, rows: Sequence[Row]) -> list[bool]:
        """Announce pages durable in the tier; per row, whether it was."""
        ...

    def read(self) -> list[Row]:
        """The next announced rows (anyone's), at most `PER_POLL`."""
        ...

    def close(self) -> None:
        ...


# Reads the stream after entry id ARGV[1] (inclusive range, then that id dropped: any Redis
# with streams), at most ARGV[2] entries; an entry whose fields and values hold more than
# ARGV[3] bytes or more than ARGV[4] strings comes back as its id alone (skipped by the reader),
# so no entry another writer put there is ever sent whole. A stream of more than ARGV[5] bytes
# (MEMORY USAGE: the sizes of its nodes, nothing copied) is not ours: it is deleted unread and
# its size comes back alone. XRANGE in a script copies every entry it returns into Lua while
# Redis serves nobody else (~7 ms a MiB on a loaded box), so a read is bounded by the stream's
# size, and the reader never meets the same large stream twice. An entry id more than
# ARGV[6] ms past the server's clock was not made by XADD '*' (ours): another writer chose it,
# and every id after it (ours too) would follow it, so a reader that moved past it would wait
# for good once the stream is deleted; such a stream is deleted unread too (-1 comes back).
_READ = """
local used = redis.call('MEMORY', 'USAGE', KEYS[1], 'SAMPLES', '0')
if used and used > tonumber(ARGV[5]) then redis.call('DEL', KEYS[1]) return used end
local got = redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', tonumber(ARGV[2]) + 1)
local count, bound, strings = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local t = redis.call('TIME')
local horizon = tonumber(t[1]) * 1000 + tonumber(ARGV[6])
local out = {}
for _, e in ipairs(got) do
  local ms = tonumber(string.match(e[1], '^(%d+)-'))
  if ms == nil or ms > horizon then redis.call('DEL', KEYS[1]) return -1 end
  if e[1] ~= ARGV[1] and #out < count then
    local f, n = e[2], 0
    if #f > strings then n = bound + 1 else for j = 1, #f do n = n + #f[j] end end
    if n > bound then out[#out + 1] = {e[1]} else out[#out + 1] = e end
  end
end
return out
"""
_INT64 = 1 << 63
# Redis's refusals of an XADD with an id of its own ('*') that no announcement can get past:
# the key is not a stream, or another writer added the largest possible id.
_NOT_A_STREAM_OF_OURS = ("WRONGTYPE", "exhausted the last possible ID")


def _int64(v: bytes) -> int:
    """A signed 64-bit decimal (a block hash), or ValueError."""
    if len(v) > 20:
        raise ValueError("too long")
    x = int(v)
    if not -_INT64 <= x < _INT64:
        raise ValueError("out of range")
    return x


class RedisFeed:
    """The announcement stream of one namespace on the Redis tier.

    What another writer can put on the stream is read under bounds, on the feed's own
    connection and breaker (`RedisLink`: a failure here backs off the feed, never the data
    path): at most `PER_POLL` entries a read, each entry at most `ENTRY_BYTES` in at most
    `ENTRY_FIELDS` fields (checked in Redis by `_READ`: a larger entry is never sent), a
    reply of at most that many bytes (the link's allowance), and a stream of at most
    `STREAM_BYTES` (a larger one is not ours: deleted unread, counted in `refused`; reading it
    would hold Redis for every client while the script copies it). A stream on which Redis
    refuses every announcement (a key of another type, the largest possible id added by another
    writer) is deleted too, counted and logged: announcements never stop silently; so is one
    holding an entry id more than `FUTURE_MS` past the server's clock (not made by XADD '*':
    a reader moved past it would wait for good once the stream is recreated). An entry
    that fails any check (too large, malformed, a key outside this namespace) is skipped,
    counted in `skipped`, and logged at most once per `LOG_EVERY_S`; the reader moves past it.
    """

    def __init__(self, redis_store: Any, digest: bytes, link: Any = None,
                 clock: Callable[[], float] = time.monotonic):
        from offload.store.redis.link import RedisLink

        self.store, self.digest = redis_store, bytes(digest)
        self.stream = bytes(redis_store.events_prefix) + digest.hex().encode()
        self.link = link or RedisLink(redis_store.cfg)    # its own connection and breaker
        self.skipped = 0
        self.refused = 0             # streams deleted unread: larger than STREAM_BYTES
        self._last = b"0-0"
        self._script: Any = None
        self._clock = clock
        self._unlogged = 0
        self._logged_at = -LOG_EVERY_S

    def publish(self, rows: Sequence[Row]) -> list[bool]:
        def add(c: Any) -> Any:
            p = c.pipeline(transaction=False)
            for r in rows:
                p.xadd(self.stream, {b"k": r.key, b"h": str(r.hash),
                                     b"p": "" if r.parent is None else str(r.parent)},
                       maxlen=STREAM_MAX, approximate=True)
            return p.execute(raise_on_error=False)

        if not rows:
            return []
        with self.link.call(0, len(rows)):
            got = self.link.run(add, "kv events announce")
        if not isinstance(got, list) or len(got) != len(rows):
            return [False] * len(rows)
        broken = next((str(g) for g in got if isinstance(g, Exception)
                       and any(m in str(g) for m in _NOT_A_STREAM_OF_OURS)), None)
        if broken is not None:         # no one can announce on it: not ours; deleted
            with self.link.call(0, 1):
                self.link.run(lambda c: c.delete(self.stream), "kv events reset")
            self.refused += 1
            self._last = b"0-0"
            self._note(f"deleted: Redis refused announcements on it ({broken[:120]}): written "
                       "by someone else; announcements stored in it are lost, later ones are "
                       "made and read")
        return [isinstance(g, bytes) for g in got]

    def read(self) -> list[Row]:
        def xrange(c: Any) -> Any:
            if self._script is None:
                self._script = c.register_script(_READ)
            return self._script(keys=[self.stream], client=c,
                                args=[self._last, PER_POLL, ENTRY_BYTES, 2 * ENTRY_FIELDS,
                                      STREAM_BYTES, FUTURE_MS])

        with self.link.call(PER_POLL * ENTRY_BYTES, PER_POLL):
            got = self.link.run(xrange, "kv events read")
        if isinstance(got, int):      # not a stream of ours: deleted, unread
            self.refused += 1
            self._last = b"0-0"       # announcements start again on a new stream
            why = (f"it held {got} bytes, more than any stream of ours ({STREAM_BYTES})"
                   if got >= 0 else "it held an entry id from the future (ours come from the "
                   "server's clock)")
            self._note(f"deleted unread: {why}: written by someone else; announcements "
                       "stored in it are lost, later ones are read")
            return []
        rows: list[Row] = []
        bad = 0
        for entry in got if isinstance(got, list) else []:
            if not (isinstance(entry, list) and entry and isinstance(entry[0], bytes)):
                bad += 1          # not an entry: a reply out of step; read again next poll
                break
            self._last = entry[0]
            row = self._row(entry)
            if row is None:
                bad += 1
            else:
                rows.append(row)
        if bad:
            self._skip(bad)
        return rows

    def _row(self, entry: list[Any]) -> Row | None:
        """The row of one entry [id, [field, value, ...]], or None when it is not a well-formed
        announcement of a block of this namespace."""
        if len(entry) != 2 or not isinstance(entry[1], list) or len(entry[1]) % 2:
            return None
        fields = dict(zip(entry[1][::2], entry[1][1::2]))
        key, h, p = fields.get(b"k"), fields.get(b"h"), fields.get(b"p", b"")
        if not (isinstance(key, bytes) and len(key) == KEY_BYTES and key.startswith(self.digest)
                and isinstance(h, bytes) and isinstance(p, bytes)):
            return None
        try:
            return Row(key, _int64(h), _int64(p) if p else None)
        except ValueError:
            return None

    def _skip(self, n: int) -> None:
        self.skipped += n
        self._unlogged += n
        self._note(f"skipped {self._unlogged} entr{'y' if self._unlogged == 1 else 'ies'} "
                   f"(larger than {ENTRY_BYTES} bytes, malformed, or not of this namespace: "
                   "written by someone else)")

    def _note(self, what: str) -> None:
        """Log what the reader refused, at most once per `LOG_EVERY_S` for this feed."""
        now = self._clock()
        if now - self._logged_at >= LOG_EVERY_S:
            log.warning("offload events: stream %r: %s", self.stream.decode(errors="replace"),
                        what)
            self._unlogged, self._logged_at = 0, now

    def close(self) -> None:
        self.link.close()


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

    def close(self) -> None:
        pass
