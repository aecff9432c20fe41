"""Two replicas (two OS processes) share blocks through Redis; blocks survive a Redis crash and
restart; a tenant's salt keeps its blocks away from every other tenant."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.store.redis_fixtures import RedisProc, redis_factory, redis_server, run_replica  # noqa: F401

pytestmark = pytest.mark.slow

PAGES = [f"prefix-page-{i}" for i in range(24)]
SIZE = 8192


def test_replica_b_hits_every_block_replica_a_wrote(redis_server: RedisProc,
                                                    tmp_path: Path) -> None:
    a = run_replica({"url": redis_server.url, "op": "put", "pages": PAGES, "size": SIZE}, tmp_path)
    assert a["results"] == [True] * len(PAGES) and a["tiers"]["shared_writes"] == len(PAGES)
    b = run_replica({"url": redis_server.url, "op": "get", "pages": PAGES, "size": SIZE}, tmp_path)
    assert b["match"] == [True] * len(PAGES)
    assert b["tiers"]["shared_hits"] == len(PAGES) and b["tiers"]["promotions"] == len(PAGES)
    assert b["shared"]["checksum_failures"] == 0


def test_blocks_survive_a_redis_crash_and_restart(redis_server: RedisProc,
                                                  tmp_path: Path) -> None:
    a = run_replica({"url": redis_server.url, "op": "put", "pages": PAGES, "size": SIZE}, tmp_path)
    assert all(a["results"])
    redis_server.kill(signal.SIGKILL)          # no clean shutdown: the AOF alone must hold them
    assert list(redis_server.dir.rglob("*.aof")), "the server should persist in its tmp dir"
    redis_server.start()
    b = run_replica({"url": redis_server.url, "op": "get", "pages": PAGES, "size": SIZE}, tmp_path)
    assert b["match"] == [True] * len(PAGES)


def test_clean_restart_with_rdb_snapshot(redis_factory, tmp_path: Path) -> None:
    server = redis_factory(["--appendonly", "no", "--save", "3600 1"])
    run_replica({"url": server.url, "op": "put", "pages": PAGES[:4], "size": SIZE}, tmp_path)
    server.kill(signal.SIGTERM)                # redis saves dump.rdb on a clean shutdown
    assert (server.dir / "dump.rdb").exists()
    server.start()
    b = run_replica({"url": server.url, "op": "get", "pages": PAGES[:4], "size": SIZE}, tmp_path)
    assert b["match"] == [True] * 4


def test_tenant_salt_isolates_blocks_in_the_shared_tier(redis_server: RedisProc,
                                                        tmp_path: Path) -> None:
    pages = PAGES[:6]
    url = redis_server.url
    a = run_replica({"url": url, "op": "put", "pages": pages, "size": SIZE, "salt": "tenant-a"},
                    tmp_path)
    assert all(a["results"])
    for salt in ("tenant-b", ""):
        other = run_replica({"url": url, "op": "get", "pages": pages, "size": SIZE,
                             "salt": salt}, tmp_path)
        assert other["results"] == [False] * len(pages), f"salt {salt!r} saw tenant-a's blocks"
    same = run_replica({"url": url, "op": "get", "pages": pages, "size": SIZE,
                        "salt": "tenant-a"}, tmp_path)
    assert same["match"] == [True] * len(pages)
    # Only namespaced keys in Redis: the salt itself is never stored.
    keys = redis_server.client().keys(b"*")
    assert keys and all(k.startswith(b"sglo:v2:") for k in keys)
    assert not any(b"tenant-a" in redis_server.client().get(k) for k in keys
                   if not k.startswith(b"sglo:v2:{"))
