"""L3 event sources on real tiers: a real `DiskStore` directory changed by another process, a
real redis-server shared by two replicas, and SGLang's own event classes.

Each test fails on the code before `offload/events/` existed (nothing emitted DISK / EXTERNAL).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from offload.config import RedisConfig
from offload.events.chain import REMOVED, STORED, Row, event_hash, events, page_rows
from offload.events.feeds import RedisFeed
from offload.events.sources import DiskSource, SharedSource
from offload.keys import Namespace
from offload.store.base import flush
from offload.store.disk.store import DiskStore
from tests.store.stores import open_store

NS = Namespace(model="m", dtype="bfloat16", layout="page_first", page_size=64, tp_rank=0,
               tp_size=1, pp_rank=0, pp_size=1, mla=False, salt="", extra="")


def page_keys(n: int, seed: str = "p") -> list[str]:
    return [hashlib.sha256(f"{seed}{i}".encode()).hexdigest() for i in range(n)]


def rows_for(keys: list[str]) -> list[Row]:
    bkeys = [NS.key(k) for k in keys]
    return page_rows(keys, bkeys, [True] * len(keys), None)


def test_rows_chain_parents_and_become_sglang_events() -> None:
    from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored

    keys = page_keys(3)
    prior = page_keys(1, "prior")[0]
    rows = page_rows(keys, [NS.key(k) for k in keys], [True, False, True], [prior])
    assert [r.hash for r in rows] == [event_hash(keys[0]), event_hash(keys[2])]
    assert rows[0].parent == event_hash(prior) and rows[1].parent == event_hash(keys[1])
    from sglang.srt.mem_cache.utils import hash_str_to_int64
    assert all(event_hash(k) == hash_str_to_int64(k) for k in keys)   # SGLang's own conversion
    chain = rows_for(keys)
    evs = events([("DISK", STORED, r) for r in chain] + [("DISK", REMOVED, chain[0])], 64)
    assert len(evs) == 2 and isinstance(evs[0], BlockStored) and isinstance(evs[1], BlockRemoved)
    assert evs[0].block_hashes == [r.hash for r in chain] and evs[0].parent_block_hash is None
    assert evs[0].medium == "DISK" and evs[0].block_size == 64 and evs[1].medium == "DISK"


def _store(path: Path) -> DiskStore:
    return open_store(path, 64 << 20)


def test_disk_source_sees_its_writes_and_another_process_evicting(tmp_path: Path) -> None:
    store = _store(tmp_path / "cache")
    store.register_namespace(NS)
    keys = page_keys(4)
    rows = rows_for(keys)
    assert all(store.put_many([r.key for r in rows], [[b"x" * 4096] for _ in rows]))
    assert flush(store)                         # the index commit of the puts (batched)
    src = DiskSource(store.directory, NS.digest())
    assert src.poll() == []                     # first poll: resync; nothing named yet
    src.wrote(rows)                             # the backend's own writes, after they are durable
    got = src.poll()
    assert sorted(got) == sorted((STORED, r) for r in rows)
    # a restarted server (a fresh source on the same directory) announces them all from L3
    again = DiskSource(store.directory, NS.digest())
    assert sorted(again.poll()) == sorted((STORED, r) for r in rows)
    subprocess.run([sys.executable, "-m", "offload.cli", "cache", "evict", store.directory,
                    "--to", "0"], check=True, capture_output=True, timeout=120)
    gone = src.poll()
    assert sorted(gone) == sorted((REMOVED, r) for r in rows)
    assert again.poll() and src.live() == [] and again.live() == []
    store.close()


@pytest.fixture
def redis_url(tmp_path: Path):
    from tests.store.redis_fixtures import RedisProc

    proc = RedisProc(tmp_path / "redis", []).start()
    try:
        yield proc.url
    finally:
        proc.kill()


def test_two_replicas_on_one_redis_see_each_others_pages_and_removals(redis_url: str) -> None:
    from offload.store.redis.store import RedisStore

    a, b = RedisStore(RedisConfig(url=redis_url)), RedisStore(RedisConfig(url=redis_url))
    sa, sb = SharedSource(a, RedisFeed(a, NS.digest())), SharedSource(b, RedisFeed(b, NS.digest()))
    rows = rows_for(page_keys(3))
    assert all(a.put_many([r.key for r in rows], [[b"y" * 1024] for _ in rows]))
    sa.wrote(rows)
    assert sorted(sa.poll()) == sorted((STORED, r) for r in rows)   # announced, read back
    assert sorted(sb.poll()) == sorted((STORED, r) for r in rows)   # the other replica
    c = RedisStore(RedisConfig(url=redis_url))
    late = SharedSource(c, RedisFeed(c, NS.digest()))
    assert len(late.poll()) == 3                                     # a new replica learns them
    assert b.delete_many([rows[0].key]) == 1
    assert sa.poll() == [(REMOVED, rows[0])] and sb.poll() == [(REMOVED, rows[0])]
    other = SharedSource(a, RedisFeed(a, Namespace(**{**NS.__dict__, "model": "other"}).digest()))
    assert other.poll() == []                                        # another namespace's stream
    for s in (a, b, c):
        s.close()


def test_sweep_source_announces_own_stores_and_finds_removals() -> None:
    """The sweep under every shared tier's source (here over an in-memory store)."""
    from offload.events.sources import SweepSource
    from offload.store.memory.store import MemoryStore

    store = MemoryStore()
    rows = rows_for(page_keys(3, "agent"))
    assert all(store.put_many([r.key for r in rows], [[b"z" * 512] for _ in rows]))
    src = SweepSource(store, "EXTERNAL", sweep=2)
    src.wrote(rows)
    assert sorted(src.poll()) == sorted((STORED, r) for r in rows)
    assert store.delete_many([rows[2].key]) == 1
    gone = src.poll() + src.poll()            # two pages per sweep: all three within two polls
    assert gone == [(REMOVED, rows[2])] and len(src.live()) == 2
