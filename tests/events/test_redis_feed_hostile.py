"""What another writer can put on the Redis KV-events stream never takes the Redis tier down.

Issue 36 item 8: a 66 MiB XADD on the announcement stream made every replica's events reader
re-read the entry forever through the data path's connection, each failure tripping the whole
tier's breaker for `backoff_s`: block hits fell from 100 % to 4-9 %. The promise
(docs/security/redis.md): a reader of anything another writer can put in Redis reads with a
per-entry bound, skips what fails (advancing past it), logs it rate-limited, and never trips the
data path's breaker. Real redis-server, real RedisStore, the real `SharedSource` / `RedisFeed`.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any, Iterator

import pytest

from offload.config import RedisConfig
from offload.events import feeds, sources_for
from offload.events.chain import STORED, Row, page_rows
from offload.events.feeds import RedisFeed
from offload.events.sources import SharedSource
from offload.keys import Namespace

NS = Namespace(model="m", dtype="bfloat16", layout="page_first", page_size=64, tp_rank=0,
               tp_size=1, pp_rank=0, pp_size=1, mla=False, salt="", extra="")
BLOCK = 16 << 10


def rows_for(n: int, seed: str) -> list[Row]:
    keys = [hashlib.sha256(f"{seed}{i}".encode()).hexdigest() for i in range(n)]
    return page_rows(keys, [NS.key(k) for k in keys], [True] * n, None)


@pytest.fixture
def redis_proc(tmp_path: Path) -> Iterator[Any]:
    from tests.store.redis_fixtures import RedisProc

    proc = RedisProc(tmp_path / "redis", []).start()
    try:
        yield proc
    finally:
        proc.kill()


def _store(url: str) -> Any:
    from offload.store.redis.store import RedisStore

    # A 5 s back-off after a failure, as deployed; a generous deadline for a loaded box.
    return RedisStore(RedisConfig(url=url, timeout_s=2.0, backoff_s=5.0))


def _hit_rate(store: Any, rows: list[Row]) -> float:
    dests = [[bytearray(BLOCK)] for _ in rows]
    got = store.get_many([r.key for r in rows], dests)
    return sum(got) / len(rows)


def test_an_oversized_stream_entry_is_skipped_and_never_trips_the_data_path(
        redis_proc: Any, caplog: pytest.LogCaptureFixture) -> None:
    store = _store(redis_proc.url)
    rows = rows_for(8, "held")
    assert all(store.put_many([r.key for r in rows], [[b"v" * BLOCK] for _ in rows]))
    (src,) = sources_for(store, NS.digest())          # as the backend builds it
    assert isinstance(src, SharedSource)
    src.wrote(rows)
    assert sorted(src.poll()) == sorted((STORED, r) for r in rows)   # announced, read back
    assert _hit_rate(store, rows) == 1.0

    # Another writer of the Redis: one 8 MiB entry on our stream (8,000 times the entry
    # bound; a stream past STREAM_BYTES is the next test's), then good announcements.
    attacker = redis_proc.client()
    stream = src.feed.stream                                           # type: ignore[attr-defined]
    attacker.xadd(stream, {b"k": b"\0" * (8 << 20)})
    later = rows_for(2, "later")
    assert all(store.put_many([r.key for r in later], [[b"w" * BLOCK] for _ in later]))
    for r in later:
        attacker.xadd(stream, {b"k": r.key, b"h": str(r.hash), b"p": ""})
    caplog.set_level(logging.WARNING)

    seen: list[tuple[str, Row]] = []
    for _ in range(6):                 # each poll, then the data path: every block still a hit
        seen += src.poll()
        assert _hit_rate(store, rows) == 1.0
        assert store.link.available() and store.link.failures == 0
    assert sorted(seen) == sorted((STORED, r._replace(parent=None)) for r in later)  # past it
    skipped = [m for m in caplog.messages if "skipped" in m and "kvev:" in m]
    assert len(skipped) == 1, caplog.messages                         # logged, once
    assert src.feed.skipped == 1                                       # type: ignore[attr-defined]
    src.close()
    store.close()


@pytest.mark.parametrize("fields", [
    {b"k": b"x" * 40, b"h": b"1", b"p": b""},                          # not a block key
    {b"k": None, b"h": b"9" * 4000, b"p": b""},                        # a hash past int64
    {b"k": None, b"h": b"1", b"p": b"-" + b"9" * 30},                  # a parent past int64
    {b"k": None, b"h": b"1", **{b"f%d" % i: b"" for i in range(64)}},  # too many fields
    {b"k": b"other-namespace", b"h": b"1", b"p": b""},                 # another namespace's key
], ids=["short-key", "huge-hash", "huge-parent", "many-fields", "foreign-key"])
def test_every_malformed_entry_is_skipped_and_the_reader_moves_on(
        redis_proc: Any, fields: dict[bytes, Any]) -> None:
    store = _store(redis_proc.url)
    feed = RedisFeed(store, NS.digest())
    good = rows_for(1, "good")[0]
    assert all(store.put_many([good.key], [[b"g" * BLOCK]]))
    other = Namespace(**{**NS.__dict__, "model": "other"}).key("ab" * 32)
    bad = {k: (good.key if v is None else other if v == b"other-namespace" else v)
           for k, v in fields.items()}
    attacker = redis_proc.client()
    attacker.xadd(feed.stream, bad)
    attacker.xadd(feed.stream, {b"k": good.key, b"h": str(good.hash), b"p": ""})
    assert feed.read() == [good._replace(parent=None)]
    assert feed.skipped == 1 and feed.read() == []
    assert store.link.failures == 0
    feed.close()
    store.close()


def test_a_stream_that_is_not_a_stream_fails_the_feed_alone(redis_proc: Any) -> None:
    """Our stream's key replaced by a string (WRONGTYPE on every read and announcement): the
    feed backs off on its own link; the data path is untouched."""
    store = _store(redis_proc.url)
    feed = RedisFeed(store, NS.digest())
    rows = rows_for(2, "typed")
    assert all(store.put_many([r.key for r in rows], [[b"t" * BLOCK] for _ in rows]))
    redis_proc.client().set(feed.stream, b"not a stream")
    assert feed.read() == [] and feed.publish(rows) == [False, False]
    assert _hit_rate(store, rows) == 1.0 and store.link.failures == 0
    feed.close()
    store.close()


@pytest.mark.parametrize("plant", ["largest id", "not a stream"])
def test_a_stream_no_one_can_announce_on_is_replaced(redis_proc: Any, plant: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Another writer adds the largest possible id (every XADD '*' after it fails: "exhausted
    the last possible ID") or puts a string at the stream's key: announcements stopped for
    every replica, silently and for good (the pages' events never came, not even the writer's
    own). The feed deletes such a stream, counted and logged; announcements go on."""
    store = _store(redis_proc.url)
    rows = rows_for(4, plant)
    assert all(store.put_many([r.key for r in rows], [[b"v" * BLOCK] for _ in rows]))
    (src,) = sources_for(store, NS.digest())
    attacker = redis_proc.client()
    stream = src.feed.stream                                           # type: ignore[attr-defined]
    if plant == "largest id":
        attacker.xadd(stream, {b"k": b"x"}, id=b"18446744073709551615-18446744073709551615")
    else:
        attacker.set(stream, b"not a stream")
    caplog.set_level(logging.WARNING)
    src.wrote(rows)
    seen: list[tuple[str, Row]] = []
    for _ in range(3):
        seen += src.poll()
    assert sorted(seen) == sorted((STORED, r) for r in rows)
    assert src.feed.refused == 1 and store.link.failures == 0          # type: ignore[attr-defined]
    assert len([m for m in caplog.messages if "refused announcements" in m]) == 1
    src.close()
    store.close()


def test_an_entry_id_from_the_future_never_strands_a_reader(redis_proc: Any,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Another writer adds an entry with an id far past the clock: every later XADD '*' id
    follows it, readers move past it, and once the stream is deleted (by them, or by the
    feed's own rules) the new stream's ids are all below their cursor: they never read an
    announcement again, silently. The read deletes a stream holding such an id, unread."""
    store = _store(redis_proc.url)
    rows, later = rows_for(2, "before"), rows_for(2, "after")
    assert all(store.put_many([r.key for r in rows + later], [[b"v" * BLOCK]] * 4))
    reader = RedisFeed(store, NS.digest())
    writer = RedisFeed(store, NS.digest())
    assert writer.publish(rows) == [True, True]
    assert reader.read() == rows
    attacker = redis_proc.client()
    attacker.xadd(reader.stream, {b"k": b"x"}, id=b"99999999999999-0")
    caplog.set_level(logging.WARNING)
    assert reader.read() == [] and reader.refused == 1 and not attacker.exists(reader.stream)
    assert len([m for m in caplog.messages if "from the future" in m]) == 1
    attacker.delete(reader.stream)
    assert writer.publish(later) == [True, True]
    assert reader.read() == later
    assert store.link.failures == 0
    reader.close()
    writer.close()
    store.close()


def test_the_read_bound_holds_every_legitimate_entry() -> None:
    """The per-entry bound is above what `publish` writes for any row (a 32-byte key, two
    20-digit signed hashes)."""
    worst = 3 + 32 + 1 + 20 + 1 + 20
    assert worst <= feeds.ENTRY_BYTES and feeds.ENTRY_FIELDS >= 3


def test_a_stream_too_large_to_read_never_stalls_the_data_path(
        redis_proc: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Four 66 MiB entries on the stream (issue 36 item 8's entry): the read script copied each
    entry it read into Lua while Redis served nobody (3.8 s on a loaded box), so the data path
    (timeout_s 0.5 s, as deployed) timed out and its breaker tripped, and the feed (the same
    timeout) never got past them: it happened again after every back-off. The read checks the
    stream's size first (MEMORY USAGE, nothing copied): a stream larger than any of ours is
    deleted unread, counted and logged; the announcements after it are read."""
    import threading

    from offload.store.redis.store import RedisStore

    store = RedisStore(RedisConfig(url=redis_proc.url, timeout_s=0.5, backoff_s=5.0))
    rows = rows_for(8, "stall")
    assert all(store.put_many([r.key for r in rows], [[b"v" * BLOCK] for _ in rows]))
    (src,) = sources_for(store, NS.digest())
    attacker = redis_proc.client()
    stream = src.feed.stream                                           # type: ignore[attr-defined]
    for _ in range(4):
        attacker.xadd(stream, {b"k": b"\0" * (66 << 20)})
    caplog.set_level(logging.WARNING)
    stop, rates = threading.Event(), []

    def data_path() -> None:             # SGLang's loads, while the events thread polls
        while not stop.is_set():
            rates.append(_hit_rate(store, rows))

    t = threading.Thread(target=data_path)
    t.start()
    try:
        for _ in range(3):
            assert src.poll() == []
    finally:
        stop.set()
        t.join(120)
    assert rates and min(rates) == 1.0 and store.link.failures == 0, store.link.last_error
    assert src.feed.refused == 1 and not attacker.exists(stream)      # type: ignore[attr-defined]
    assert len([m for m in caplog.messages if "deleted unread" in m and "kvev:" in m]) == 1
    src.wrote(rows[:2])
    assert sorted(src.poll()) == sorted((STORED, r) for r in rows[:2])
    assert src.feed.refused == 1 and store.link.failures == 0          # type: ignore[attr-defined]
    src.close()
    store.close()
