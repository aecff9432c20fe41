"""What another writer of our keys plants in the Redis tier's own records never trips the breaker.

The promise of issue 36 item 8 for every reader of what another writer can put in Redis (the
KV-events stream: tests/events/test_redis_feed_hostile.py), here for the tier's own records
under its prefix: the `max_bytes` index (an LRU sorted set, a size hash, a byte counter), read
by the budget scripts and by `stats()`. Planted values (a 66 MiB counter, a 66 MiB member, sizes
that are not numbers, keys of the wrong type) are read under a per-entry bound, what fails is
skipped, and the data path's breaker never trips: every block stays a hit, and
`link.failures` stays 0. Real redis-server.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from offload.keys import Namespace
from tests.store.redis_fixtures import redis_factory, redis_store  # noqa: F401

NS = Namespace("planted", "bf16", "layer_first", 16)
SIZE = 16 << 10
BIG = 66 << 20
TIMEOUT_S = 0.5


def _plant_counter(c: Any, store: Any) -> None:
    c.set(store.idx_keys[2], b"9" * BIG)                       # the byte counter: 66 MiB


def _plant_member(c: Any, store: Any) -> None:
    member = store.prefix + b"x" * BIG                          # the oldest member: 66 MiB
    c.zadd(store.idx_keys[0], {member: 0})
    c.hset(store.idx_keys[1], member, 1 << 30)
    c.incrby(store.idx_keys[2], 1 << 30)


def _plant_sizes(c: Any, store: Any) -> None:
    c.zadd(store.idx_keys[0], {store.prefix + b"y" * 32: 0})  # a size that is not a number
    c.hset(store.idx_keys[1], store.prefix + b"y" * 32, b"not a number")
    c.set(store.idx_keys[2], b"also not a number")


def _plant_types(c: Any, store: Any) -> None:
    for k in store.idx_keys:                                   # every index key a list
        c.delete(k)
        c.rpush(k, b"a list")


PLANTS: dict[str, Callable[[Any, Any], None]] = {
    "66 MiB counter": _plant_counter, "66 MiB member": _plant_member,
    "sizes not numbers": _plant_sizes, "wrong types": _plant_types}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_index_records_never_trip_the_data_path(redis_factory, plant: str) -> None:  # noqa: F811
    server = redis_factory([])         # no AOF: what is measured is the reply, not the disk
    # A generous deadline: the scripts handle a 66 MiB member in Redis on a loaded box.
    store = redis_store(server.url, TIMEOUT_S, 5.0, max_bytes="1MiB")
    keys = [NS.key(f"page-{i}") for i in range(8)]
    assert all(store.put_many(keys, [[bytes([i]) * SIZE] for i in range(8)]))
    PLANTS[plant](server.client(), store)
    more = [NS.key(f"more-{i}") for i in range(80)]            # past the budget: evictions
    for i in range(0, 80, 8):
        store.stats()                                          # a metrics scrape between puts
        store.put_many(more[i:i + 8], [[b"m" * SIZE] for _ in range(8)])
        got = store.get_many(keys[:2], [[bytearray(SIZE)] for _ in range(2)])
        assert store.link.failures == 0, (plant, store.link.last_error)
    held = store.get_many(more[-8:], [[bytearray(SIZE)] for _ in range(8)])
    assert all(held), (plant, held, got)                       # the newest blocks: hits
    assert store.link.available() and store.link.failures == 0, store.link.last_error
    store.close()


@pytest.mark.slow          # 14 s: the quick loop keeps the planted index records above
def test_a_planted_counter_over_many_blocks_never_trips_the_data_path(redis_factory) -> None:  # noqa: F811
    """A counter planted valid but huge (a number, so not reset) makes every block look past
    the budget: one put must not pop the whole index in one script (a reply of every key we
    hold, longer than the put's reply allowance, tripped the breaker; and the script held Redis
    for all of it). The budget script pops a bounded number a call."""
    server = redis_factory([])
    store = redis_store(server.url, 5.0, 5.0, max_bytes="1GiB")
    n = 40_000                                             # ~2.4 MB of victim keys in one reply
    for lo in range(0, n, 4_000):
        keys = [NS.key(f"small-{i}") for i in range(lo, lo + 4_000)]
        assert all(store.put_many(keys, [[b"s" * 64] for _ in keys]))
    server.client().set(store.idx_keys[2], b"1" + b"0" * 18)  # 10^18 bytes "used"
    fresh = [NS.key(f"fresh-{i}") for i in range(4)]
    for i in range(len(fresh)):
        store.put_many(fresh[i:i + 1], [[b"f" * 64]])
        assert store.link.failures == 0, store.link.last_error
    assert all(store.get_many(fresh, [[bytearray(64)] for _ in fresh]))   # the newest: hits
    assert store.link.available() and store.link.failures == 0, store.link.last_error
    store.close()


def test_a_planted_key_name_past_the_reply_bound_never_trips_the_data_path(redis_factory) -> None:  # noqa: F811
    """SGLang's clear-storage call runs `clear()` in the serving process: its SCAN pages are
    names another writer can plant under our prefix. A 65 MiB key name (past the 64 MiB reply
    allowance of a control call) failed the page on the data path's link: its breaker tripped,
    every load a miss for `backoff_s`. The SCAN runs on a link of its own."""
    server = redis_factory([])
    store = redis_store(server.url, 5.0, 5.0)
    keys = [NS.key(f"clear-{i}") for i in range(8)]
    assert all(store.put_many(keys, [[bytes([i]) * SIZE] for i in range(8)]))
    server.client().set(store.rkey(NS.digest()) + b"x" * (65 << 20), b"planted")
    store.clear(NS.digest())
    assert store.link.failures == 0 and store.link.available(), store.link.last_error
    assert store.put_many(keys[:1], [[b"n" * SIZE]]) == [True]     # the tier still serves
    store.close()
