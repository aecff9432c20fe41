"""RedisStore against a real redis-server: round trips, verification, budget, ttl, clear."""

from __future__ import annotations

import struct

import pytest

from offload.config import ConfigError, load_offload
from offload.keys import Namespace
from offload.store.base import get_bytes
from offload.store.redis.store import RedisStore
from offload.store.redis.value import HEADER, MAGIC, VERSION, ValueCodec
from tests.store.redis_fixtures import RedisProc, block_bytes, redis_factory, redis_server  # noqa: F401

NS = Namespace("test-model", "bf16", "layer_first", 16)
SIZE = 4096


def make(url: str, **redis: object) -> RedisStore:
    return RedisStore(load_offload({"redis": {"url": url, "timeout_s": 2.0, **redis}}).redis)


def keys(n: int, start: int = 0, ns: Namespace = NS) -> list[bytes]:
    return [ns.key(f"page-{i}") for i in range(start, start + n)]


def test_round_trip_vectored_and_pipelined(redis_server: RedisProc) -> None:
    s = make(redis_server.url)
    ks = keys(10)
    blocks = [[block_bytes(str(i), 1000), memoryview(block_bytes(str(i), 3096)), bytearray(0)]
              for i in range(10)]
    assert s.put_many(ks, blocks) == [True] * 10
    assert s.exists_many(ks + keys(2, 100)) == [True] * 10 + [False, False]
    dests = [[bytearray(3000), bytearray(1096)] for _ in ks]
    assert s.get_many(ks, dests) == [True] * 10
    for d, b in zip(dests, blocks):
        assert bytes(d[0]) + bytes(d[1]) == b"".join(bytes(x) for x in b)
    # Stored under the prefixed key with the versioned header; a second put writes nothing.
    raw = redis_server.client().get(b"sglo:v2:" + ks[0])
    magic, version, _, _, length, _nonce, _tag = HEADER.unpack_from(raw)
    assert (magic, version, length, VERSION) == (MAGIC, 2, 4096, 2)
    assert s.codec.open(b"sglo:v2:" + ks[0], raw) is not None
    assert s.put_many(ks[:2], blocks[:2]) == [True, True]
    st = s.stats()
    assert (st.puts, st.hits, st.misses) == (10, 10, 0)
    assert s.delete_many(ks[:3]) == 3 and s.exists_many(ks[:4]) == [False] * 3 + [True]


def test_wrong_destination_size_is_a_miss_not_corruption(redis_server: RedisProc) -> None:
    s = make(redis_server.url)
    k = keys(1)
    s.put_many(k, [[block_bytes("a", SIZE)]])
    assert s.get_many(k, [[bytearray(SIZE - 1)]]) == [False]
    assert s.exists_many(k) == [True] and s.stats().extra["size_mismatches"] == 1


def _bad_values(good: bytes) -> dict[str, bytes]:
    body = good[HEADER.size:]
    flipped = bytearray(good)
    flipped[-1] ^= 0xFF
    return {
        "junk": b"not a block at all",
        "empty": b"",
        "flipped_byte": bytes(flipped),
        "truncated": good[:-10],
        "wrong_magic": b"XXXX" + good[4:],
        "future_version": good[:4] + b"\x09" + good[5:],
        "length_lies": good[:8] + struct.pack("<Q", len(body) + 1) + good[16:],
    }


@pytest.mark.parametrize("kind", list(_bad_values(b"\0" * (HEADER.size + 16))))
def test_garbage_under_our_key_is_a_miss_left_in_place(redis_server: RedisProc, kind: str) -> None:
    """A value we cannot verify is not provably ours: a miss, counted, never deleted (issue 26;
    before, the tier DELeted it). An empty value reads as an absent key: a plain miss."""
    s = make(redis_server.url)
    k = keys(1)
    s.put_many(k, [[block_bytes("g", SIZE)]])
    r = redis_server.client()
    rk = b"sglo:v2:" + k[0]
    bad = _bad_values(r.get(rk))[kind]
    r.set(rk, bad)
    dest = bytearray(b"\x5a" * SIZE)
    assert s.get_many(k, [[dest]]) == [False]
    assert dest == b"\x5a" * SIZE, "nothing of a bad value reaches the caller"
    assert r.get(rk) == bad, "a value we cannot verify must not be deleted"
    assert s.stats().checksum_failures == (0 if kind == "empty" else 1)
    # An explicit delete removes it; the next writer stores a good copy again.
    assert s.delete_many(k) == 1
    assert s.put_many(k, [[block_bytes("g", SIZE)]]) == [True]
    assert get_bytes(s, k[0], SIZE) == block_bytes("g", SIZE)


def test_open_rejects_every_bad_form() -> None:
    codec = ValueCodec(b"k" * 32)
    body = block_bytes("x", 64)
    good = codec.seal(b"sglo:v2:key", [memoryview(body)]) + body
    assert bytes(codec.open(b"sglo:v2:key", good) or b"") == body
    for kind, bad in _bad_values(good).items():
        assert codec.open(b"sglo:v2:key", bad) is None, kind


def test_ttl_is_set_and_slides_on_hits(redis_server: RedisProc) -> None:
    s = make(redis_server.url, ttl_s=100)
    k = keys(1)
    s.put_many(k, [[block_bytes("t", SIZE)]])
    r = redis_server.client()
    rk = b"sglo:v2:" + k[0]
    assert 0 < r.ttl(rk) <= 100
    r.expire(rk, 5)
    assert get_bytes(s, k[0], SIZE) is not None
    assert r.ttl(rk) > 5, "a hit must refresh the expiry (GETEX)"


def test_budget_evicts_least_recently_used(redis_server: RedisProc) -> None:
    s = make(redis_server.url, max_bytes=5 * SIZE)
    first = keys(4)
    assert all(s.put_many(first, [[block_bytes(str(i), SIZE)] for i in range(4)]))
    assert get_bytes(s, first[0], SIZE) is not None         # first[0] is now the most recent
    more = keys(3, 10)
    assert all(s.put_many(more, [[block_bytes(str(i), SIZE)] for i in range(3)]))
    st = s.stats()
    assert st.bytes_used <= 5 * SIZE and st.blocks == 5 and st.evictions == 2
    # first[1:] were written in one batch (one timestamp): any two of them go, first[0] stays.
    assert s.exists_many(first)[0] and sum(s.exists_many(first[1:])) == 1
    assert s.exists_many(more) == [True] * 3
    # A block bigger than the whole budget is refused, not stored and evicted at once.
    assert s.put_many(keys(1, 50), [[bytes(6 * SIZE)]]) == [False]
    # Blocks Redis drops by itself leave the index when found missing.
    redis_server.client().delete(b"sglo:v2:" + more[0])
    assert s.get_many(more[:1], [[bytearray(SIZE)]]) == [False]
    assert s.stats().bytes_used == 4 * SIZE


def test_budget_is_shared_by_two_clients(redis_server: RedisProc) -> None:
    a, b = make(redis_server.url, max_bytes=4 * SIZE), make(redis_server.url, max_bytes=4 * SIZE)
    a.put_many(keys(3), [[bytes(SIZE)]] * 3)
    b.put_many(keys(3, 10), [[bytes(SIZE)]] * 3)
    assert a.stats().bytes_used == b.stats().bytes_used == 4 * SIZE
    assert sum(a.exists_many(keys(3) + keys(3, 10))) == 4


def test_namespace_registered(redis_server: RedisProc) -> None:
    s = make(redis_server.url)
    s.register_namespace(Namespace("m", "fp8", "page_first", 64, salt="secret"))
    stored = [redis_server.client().get(k) for k in redis_server.client().keys(b"sglo:v2:ns:*")]
    assert len(stored) == 1 and b"secret" not in stored[0] and b"fp8" in stored[0]


def test_a_missing_password_file_is_a_config_error() -> None:
    """(The URL grammar itself: tests/config/test_redis_url.py.)"""
    with pytest.raises(ConfigError, match="password_file"):
        make("redis://h", password_file="/nonexistent/pw")


def test_redis_not_imported_by_offload() -> None:
    import subprocess
    import sys

    code = ("import sys, offload, offload.store.redis.store, offload.store.tiered, offload.bench.redis;"
            "print('redis' in sys.modules or 'cryptography' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_many_threads_share_one_store(redis_server: RedisProc) -> None:
    from concurrent.futures import ThreadPoolExecutor

    s = make(redis_server.url)

    def work(t: int) -> bool:
        ks = keys(8, 100 * t)
        data = [[block_bytes(f"{t}-{i}", SIZE)] for i in range(8)]
        if not all(s.put_many(ks, data)):
            return False
        dests = [[bytearray(SIZE)] for _ in ks]
        return all(s.get_many(ks, dests)) and [bytes(d[0]) for d in dests] == [d[0] for d in data]

    with ThreadPoolExecutor(6) as pool:
        assert all(pool.map(work, range(12)))
    st = s.stats()
    assert (st.puts, st.hits) == (96, 96)


def test_clear_by_namespace_uses_scan_and_keeps_other_namespaces(redis_server):
    from offload.config import RedisConfig
    from offload.keys import Namespace
    from offload.store.redis.store import RedisStore

    a = Namespace("m", "bf16", "page_first", 16, salt="a")
    b = Namespace("m", "bf16", "page_first", 16, salt="b")
    s = RedisStore(RedisConfig(url=redis_server.url))
    try:
        ka, kb = [a.key(f"p{i}") for i in range(5)], [b.key(f"p{i}") for i in range(3)]
        assert all(s.put_many(ka + kb, [[b"x" * 100]] * 8))
        assert s.clear(a.digest()) == 5
        assert s.exists_many(ka + kb) == [False] * 5 + [True] * 3
        assert s.clear() == 3
    finally:
        s.close()
