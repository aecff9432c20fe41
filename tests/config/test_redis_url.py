"""The grammar of `offload.redis.url` (offload/config/redis_url.py): standalone or cluster, TLS or
not, IPv6 nodes, credentials kept out of `display()`; every malformed URL a `ConfigError`, early
(before redis-py would refuse it at connect time); TLS settings need a rediss:// URL."""

from __future__ import annotations

import pytest

from offload.config import ConfigError, load_offload, parse_url


def test_url_parsing_and_errors() -> None:
    t = parse_url("rediss+cluster://user:p%40ss@h1:7000,h2:7001")
    assert (t.tls, t.cluster, t.nodes, t.username, t.password) == (
        True, True, [("h1", 7000), ("h2", 7001)], "user", "p@ss")
    assert "p@ss" not in t.display()
    assert parse_url("redis://[::1]:6380/2").nodes == [("::1", 6380)]
    assert parse_url("redis://localhost").nodes == [("localhost", 6379)]
    assert parse_url("redis://[fe80::1%eth0]").nodes == [("fe80::1%eth0", 6379)]
    for bad in ("http://x", "redis://a:1,b:2", "redis://h:99999", "redis://h/x",
                "redis://h?ssl_cert_reqs=none", "redis+cluster://h/3",
                # redis-py refuses these at connect time ("Invalid IPv6 URL", ...): so do we, early
                "redis://:pw@[bad", "redis://[::1", "redis://[::1]x", "redis://h h:1", "redis://::1"):
        with pytest.raises(ConfigError):
            parse_url(bad)
    with pytest.raises(ConfigError, match="rediss"):
        load_offload({"redis": {"url": "redis://h", "tls_ca_file": "/ca"}})
