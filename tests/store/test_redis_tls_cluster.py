"""The Redis tier over TLS (self-signed CA made by the test) and on a 3-node Redis Cluster."""

from __future__ import annotations

from typing import Any

import pytest

from offload.config import load_offload
from offload.keys import Namespace
from offload.store.base import get_bytes
from offload.store.redis.store import RedisStore
from tests.store.redis_fixtures import (  # noqa: F401
    RedisProc,
    block_bytes,
    redis_cluster,
    redis_factory,  # noqa: F401
    tls_certs,
)

pytestmark = pytest.mark.slow

NS = Namespace("test-model", "bf16", "layer_first", 16)
SIZE = 4096


def make(url: str, **redis: Any) -> RedisStore:
    return RedisStore(load_offload({"redis": {"url": url, "timeout_s": 2.0, **redis}}).redis)


def test_tls_with_client_certificate(redis_factory, tls_certs: dict[str, str]) -> None:
    server = redis_factory(["--tls-cert-file", tls_certs["server_crt"],
                            "--tls-key-file", tls_certs["server_key"],
                            "--tls-ca-cert-file", tls_certs["ca_crt"],
                            "--tls-auth-clients", "yes"], tls=True)
    assert server.url.startswith("rediss://")
    k = NS.key("tls")
    ok = make(server.url, tls_ca_file=tls_certs["ca_crt"], tls_cert_file=tls_certs["client_crt"],
              tls_key_file=tls_certs["client_key"])
    assert ok.put_many([k], [[block_bytes("tls", SIZE)]]) == [True]
    assert get_bytes(ok, k, SIZE) == block_bytes("tls", SIZE)

    # The server's certificate is not trusted without our CA.
    untrusted = make(server.url)
    assert untrusted.exists_many([k]) == [False]
    assert "certificate" in untrusted.link.last_error.lower(), untrusted.link.last_error
    # The server requires a client certificate.
    anonymous = make(server.url, tls_ca_file=tls_certs["ca_crt"])
    assert anonymous.exists_many([k]) == [False] and anonymous.link.failures == 1
    # Plain redis:// to a TLS port fails cleanly too.
    plain = make(server.url.replace("rediss://", "redis://"))
    assert plain.exists_many([k]) == [False] and plain.link.failures == 1


def _node_of(nodes: list[RedisProc], rkey: bytes) -> RedisProc:
    """The node serving the slot of `rkey` (the others answer MOVED)."""
    slot = nodes[0].client().cluster("keyslot", rkey)
    for n in nodes:
        for start, end, *_ in n.client().execute_command("CLUSTER SLOTS"):
            if start <= slot <= end and int(_[0][1]) == n.port:
                return n
    raise AssertionError(f"no node serves slot {slot}")


def test_cluster_spreads_blocks_and_serves_them(redis_cluster: list[RedisProc]) -> None:
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in redis_cluster[:2])
    s = make(url, max_bytes=40 * SIZE)
    ks = [NS.key(f"c{i}") for i in range(30)]
    data = [[block_bytes(f"c{i}", SIZE)] for i in range(30)]
    assert s.put_many(ks, data) == [True] * 30
    per_node = [n.client().dbsize() for n in redis_cluster]
    assert sum(1 for c in per_node if c > 0) == 3, per_node
    other = make(url)                          # another client of the same cluster
    dests = [[bytearray(SIZE)] for _ in ks]
    assert other.get_many(ks, dests) == [True] * 30
    assert [bytes(d[0]) for d in dests] == [d[0] for d in data]
    assert s.stats().bytes_used == 30 * SIZE   # the budget index works on a cluster too
    # A corrupt value on whichever node holds it is a miss, left in place.
    rk = b"sglo:v2:" + ks[7]
    node = _node_of(redis_cluster, rk)
    node.client().set(rk, b"garbage")
    assert other.get_many(ks[7:8], [[bytearray(SIZE)]]) == [False]
    assert node.client().get(rk) == b"garbage" and other.stats().checksum_failures == 1
    assert other.delete_many(ks[:5]) == 5 and other.exists_many(ks[:6]) == [False] * 5 + [True]
