"""The Redis tier under a slow or hostile Redis (issue 26, break 6): every call has a deadline,
no reply is read past the length we wrote, a reply stream out of step drops the connection, and
a value we cannot verify is a miss that stays where it is (never deleted).

Time bounds asserted here are hang detectors (10x the configured timeout), not performance
figures: before the fix these calls took 10 s to minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from offload.keys import Namespace
from offload.store.redis.store import RedisStore
from offload.store.redis.value import HEADER
from tests.store.hostile_redis import HostileProxy
from tests.store.redis_fixtures import RedisProc, block_bytes, redis_factory, redis_server, redis_store  # noqa: F401

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
NS = Namespace("test-model", "bf16", "layer_first", 16)
SIZE = 2048
TIMEOUT, BACKOFF = 0.5, 0.3


def make(url: str, **redis: object) -> RedisStore:
    return redis_store(url, TIMEOUT, BACKOFF, **redis)


def keys(n: int) -> list[bytes]:
    return [NS.key(f"page-{i}") for i in range(n)]


@pytest.fixture
def proxy(redis_server: RedisProc):  # noqa: F811
    p = HostileProxy(redis_server.port)
    yield p
    p.close()


@pytest.mark.timeout(120)
def test_a_server_dripping_bytes_cannot_hold_a_call_past_its_deadline(proxy: HostileProxy) -> None:
    """One byte every 0.3 s never trips a 0.5 s socket timeout: before, exists_many(8) took
    ~10 s and get_many(1) minutes. Now each call ends near its deadline, as misses."""
    writer = make(proxy.url, timeout_s=5.0)  # honest yet: a loaded machine must not fail it
    ks = keys(8)
    assert writer.put_many(ks, [[block_bytes(str(i), SIZE)] for i in range(8)]) == [True] * 8
    writer.close()
    proxy.drip_s = 0.3

    s = make(proxy.url)
    t = time.monotonic()
    found = s.exists_many(ks)
    assert time.monotonic() - t < 10 * TIMEOUT, "exists_many(8) outlived its deadline"
    assert found == [False] * 8
    assert s.link.timeouts == 1

    time.sleep(BACKOFF * 1.5)
    done: list[list[bool]] = []
    th = threading.Thread(target=lambda: done.append(s.get_many(ks[:1], [[bytearray(SIZE)]])),
                          daemon=True)
    t = time.monotonic()
    th.start()
    th.join(10 * TIMEOUT)
    hung = th.is_alive()
    proxy.drip_s = None                       # release a hung call before failing
    proxy.close()
    th.join(30)
    assert not hung, "get_many(1) still blocked after 10x timeout_s"
    assert done == [[False]] and s.link.timeouts == 2
    assert time.monotonic() - t < 10 * TIMEOUT
    s.close()


def test_one_extra_reply_drops_the_connection_and_deletes_nothing(proxy: HostileProxy,
                                                                  redis_server: RedisProc  # noqa: F811
                                                                  ) -> None:
    """An extra reply ahead of a GET pipeline shifts every value onto the next key. Before: the
    shifted values failed their MAC and were DELeted (good blocks lost for every replica).
    Now: the shift is caught, the connection dropped, nothing served wrong and nothing deleted;
    once the server is honest again every block is served."""
    s = make(proxy.url, timeout_s=5.0)
    ks = keys(48)
    want = [block_bytes(str(i), SIZE) for i in range(48)]
    assert s.put_many(ks, [[w] for w in want]) == [True] * 48
    proxy.inject(b"$5\r\nhello\r\n")
    for start in range(0, 48, 8):
        dests = [[bytearray(SIZE)] for _ in range(8)]
        got = s.get_many(ks[start:start + 8], dests)
        for ok, d, w in zip(got, dests, want[start:]):
            assert not ok or bytes(d[0]) == w, "a shifted value was served"
        time.sleep(BACKOFF * 1.5)
    assert redis_server.client().exists(*[s.rkey(k) for k in ks]) == 48, "values were deleted"
    time.sleep(BACKOFF * 1.5)
    dests = [[bytearray(SIZE)] for _ in ks]
    assert s.get_many(ks, dests) == [True] * 48
    assert [bytes(d[0]) for d in dests] == want
    assert s.stats().extra["protocol_errors"] >= 1
    s.close()


_RSS_PROBE = r"""
import json, resource, sys
from offload.config import load_offload
from offload.keys import Namespace
from offload.store.redis.store import RedisStore

cfg = load_offload({"redis": {"url": sys.argv[1], "timeout_s": 5.0}}).redis
s = RedisStore(cfg)
ns = Namespace("test-model", "bf16", "layer_first", 16)
ks = [ns.key(f"page-{i}") for i in range(4)]
s.exists_many(ks)                                   # connected, warmed up
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
got = s.get_many(ks, [[bytearray(16 << 10)] for _ in ks])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
st = s.stats()
print(json.dumps({"got": got, "grew_kib": after - before, "mismatches":
                  st.extra["size_mismatches"], "checksum_failures": st.checksum_failures}))
"""


@pytest.mark.timeout(180)
def test_planted_large_values_are_not_read_whole(redis_server: RedisProc) -> None:  # noqa: F811
    """Another user of the Redis plants 4 x 96 MiB values at our keys. Before, a 16 KiB get read
    them whole (the reader's RSS +390 MiB) and then deleted them. Now the read stops one byte
    past the length we wrote: a miss, counted, and the values stay where they are."""
    s = make(redis_server.url)
    rkeys = [s.rkey(k) for k in keys(4)]
    r = redis_server.client()
    for rk in rkeys:                          # 96 MiB made by the server: none in this process
        r.setrange(rk, (96 << 20) - 1, b"x")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, redis_server.url], env=env,
                         capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["got"] == [False] * 4
    assert res["grew_kib"] < 64 << 10, f"RSS grew by {res['grew_kib'] >> 10} MiB"
    assert res["mismatches"] == 4 and res["checksum_failures"] == 0
    assert [r.strlen(rk) for rk in rkeys] == [96 << 20] * 4, "planted values were deleted"
    # A value of exactly our length that fails the MAC: a miss, counted, left in place.
    forged = b"\0" * (HEADER.size + SIZE)
    r.set(rkeys[0], forged)
    assert s.get_many(keys(1), [[bytearray(SIZE)]]) == [False]
    assert s.stats().checksum_failures == 1 and r.get(rkeys[0]) == forged
    s.close()


def test_a_reply_longer_than_the_call_expects_drops_the_connection(proxy: HostileProxy) -> None:
    """A server announcing a 64 MiB string and sending it: reading stops past what the call
    expects (its values + framing + 1 MiB), the connection is dropped, nothing is buffered whole."""
    s = make(proxy.url, timeout_s=5.0)
    ks = keys(2)
    assert s.put_many(ks, [[block_bytes(str(i), SIZE)] for i in range(2)]) == [True] * 2
    proxy.inject(b"$%d\r\n" % (64 << 20) + b"x" * (8 << 20))
    assert s.get_many(ks, [[bytearray(SIZE)] for _ in ks]) == [False, False]
    assert s.stats().extra["protocol_errors"] == 1
    time.sleep(BACKOFF * 1.5)
    dests = [[bytearray(SIZE)] for _ in ks]
    assert s.get_many(ks, dests) == [True, True]
    assert [bytes(d[0]) for d in dests] == [block_bytes(str(i), SIZE) for i in range(2)]
    s.close()
