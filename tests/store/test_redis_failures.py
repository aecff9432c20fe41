"""Failure behaviour: Redis killed and restarted, hung, refusing AUTH; local NVMe keeps serving.

Time bounds asserted here are hang detectors (10x slack over the configured timeout), not
performance figures: without the timeout the calls would block forever.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from offload.errors import StoreError
from offload.keys import Namespace
from offload.store.base import get_bytes
from offload.store.memory.store import MemoryStore
from offload.store.redis.store import RedisStore
from offload.store.tiered import TieredStore, WriteThrough
from tests.store.redis_fixtures import RedisProc, block_bytes, redis_factory, redis_server, redis_store  # noqa: F401

pytestmark = pytest.mark.slow

NS = Namespace("test-model", "bf16", "layer_first", 16)
SIZE = 2048
TIMEOUT, BACKOFF = 0.3, 0.3


def make(url: str, **redis: object) -> RedisStore:
    return redis_store(url, TIMEOUT, BACKOFF, **redis)


def blocks(pages: list[str]) -> list[list[bytes]]:
    return [[block_bytes(p, SIZE)] for p in pages]


def wait_out_backoff() -> None:
    time.sleep(BACKOFF * 1.5)


def test_killed_mid_run_serves_local_backs_off_and_reconnects(redis_server: RedisProc) -> None:
    shared = make(redis_server.url)
    tier = TieredStore(MemoryStore(), shared, WriteThrough())
    pages = [f"p{i}" for i in range(10)]
    ks = [NS.key(p) for p in pages]
    assert tier.put_many(ks, blocks(pages)) == [True] * 10
    only_shared = NS.key("only-in-redis")
    assert shared.put_many([only_shared], blocks(["only-in-redis"])) == [True]

    redis_server.kill(signal.SIGKILL)
    # Local blocks are served; a block only in Redis is a miss; the failure is counted once.
    dests = [[bytearray(SIZE)] for _ in ks]
    assert tier.get_many(ks, dests) == [True] * 10
    assert [bytes(d[0]) for d in dests] == [b[0] for b in blocks(pages)]
    assert tier.get_many([only_shared], [[bytearray(SIZE)]]) == [False]
    assert shared.link.failures == 1
    # Within the back-off nobody touches the dead server.
    t = time.monotonic()
    assert tier.get_many([only_shared], [[bytearray(SIZE)]]) == [False]
    assert tier.exists_many([only_shared]) == [False]
    assert shared.link.failures == 1 and shared.link.skipped_while_down >= 2
    assert time.monotonic() - t < 10 * TIMEOUT
    # Writes while Redis is down land locally and succeed.
    new_pages = ["n0", "n1"]
    new = [NS.key(p) for p in new_pages]
    assert tier.put_many(new, blocks(new_pages)) == [True, True]
    assert tier.stats().extra["tiers"]["shared_write_failures"] >= 2

    redis_server.start()                      # same port, same AOF: the old blocks are back
    wait_out_backoff()
    assert get_bytes(tier, only_shared, SIZE) == block_bytes("only-in-redis", SIZE)
    assert shared.link.reconnects == 1 and shared.stats().extra["down"] is False
    # The blocks written during the outage reach Redis on their next local hit.
    for k, p in zip(new, new_pages):
        assert get_bytes(tier, k, SIZE) == block_bytes(p, SIZE)
    tier.flush()
    assert shared.exists_many(new) == [True, True]
    tier.close()


def test_dead_redis_costs_one_timeout_then_nothing(redis_factory) -> None:
    server = redis_factory()
    url = server.url
    server.kill(signal.SIGKILL)                # nothing listens on the port now
    s = make(url, backoff_s=60)
    t = time.monotonic()
    for _ in range(20):
        assert s.get_many([NS.key("x")], [[bytearray(SIZE)]]) == [False]
        assert s.put_many([NS.key("x")], blocks(["x"])) == [False]
    assert time.monotonic() - t < 10 * TIMEOUT
    assert s.link.failures == 1 and s.link.skipped_while_down == 39
    st = s.stats()
    assert st.misses == 20 and st.put_skipped == 20 and st.extra["down"] is True
    with pytest.raises(StoreError, match="not usable"):
        s.ping()


@pytest.mark.timeout(60)  # without the socket timeout this call would block forever
def test_hung_redis_times_out(redis_server: RedisProc) -> None:
    s = make(redis_server.url, timeout_s=1.0)
    k = NS.key("h")
    assert s.put_many([k], blocks(["h"])) == [True]
    assert redis_server.proc is not None
    redis_server.kill(signal.SIGSTOP)
    try:
        t = time.monotonic()
        assert s.get_many([k], [[bytearray(SIZE)]]) == [False]
        # One timeout (1 s), not one per retry (redis-py's default would retry 3 times).
        assert time.monotonic() - t < 2.5
        assert s.link.timeouts == 1 and s.link.failures == 1
    finally:
        redis_server.kill(signal.SIGCONT)
    wait_out_backoff()
    assert get_bytes(s, k, SIZE) == block_bytes("h", SIZE)


def test_auth_required_and_wrong_password_refused(redis_factory, tmp_path: Path) -> None:
    server = redis_factory(password="s3cret-pw")
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text("s3cret-pw\n")
    bad.write_text("wrong\n")
    good.chmod(0o600)
    bad.chmod(0o600)
    k = NS.key("a")

    ok = make(server.url, password_file=str(good))
    assert ok.put_many([k], blocks(["a"])) == [True]
    assert get_bytes(ok, k, SIZE) == block_bytes("a", SIZE)
    ok.ping()

    for name, store in (("wrong password", make(server.url, password_file=str(bad))),
                        ("no password", make(server.url))):
        assert store.get_many([k], [[bytearray(SIZE)]]) == [False], name
        assert store.put_many([NS.key("b")], blocks(["b"])) == [False], name
        assert "authentication" in store.link.last_error.lower(), (name, store.link.last_error)
        with pytest.raises(StoreError, match="(?i)auth"):
            store.ping()
    assert ok.exists_many([NS.key("b")]) == [False]
    # A password in the URL works too (password_file wins when both are set).
    assert make(server.url.replace("//", "//:s3cret-pw@")).exists_many([k]) == [True]
