"""TieredStore: local first, shared next, promotion, write policies, failures, attribution."""

from __future__ import annotations

from pathlib import Path

from offload.config import load_offload
from offload.keys import Namespace
from offload.store.base import get_bytes
from offload.store.faults import FaultyMemoryStore
from offload.store.memory.store import MemoryStore
from offload.store.tiered import SeenN, TieredStore, WriteThrough, make_tiered, policy_from_config
from tests.store.redis_fixtures import RedisProc, block_bytes, redis_factory, redis_server  # noqa: F401
from tests.store.stores import open_store

NS = Namespace("test-model", "bf16", "layer_first", 16)
SIZE = 1024


def ks(*names: str) -> list[bytes]:
    return [NS.key(n) for n in names]


def data(*names: str) -> list[list[bytes]]:
    return [[block_bytes(n, SIZE)] for n in names]


def tiers(policy: object = None) -> tuple[TieredStore, FaultyMemoryStore, FaultyMemoryStore]:
    local, shared = FaultyMemoryStore(), FaultyMemoryStore()
    return TieredStore(local, shared, policy or WriteThrough()), local, shared  # type: ignore


def test_write_through_writes_both_and_reads_local_first() -> None:
    t, local, shared = tiers()
    assert t.put_many(ks("a", "b"), data("a", "b")) == [True, True]
    assert local.exists_many(ks("a", "b")) == shared.exists_many(ks("a", "b")) == [True, True]
    shared.fail_reads.add(NS.key("a"))         # a read that reached the shared tier would miss
    assert get_bytes(t, NS.key("a"), SIZE) == block_bytes("a", SIZE)
    c = t.stats().extra["tiers"]
    assert (c["local_hits"], c["shared_hits"], c["shared_writes"]) == (1, 0, 2)


def test_shared_hit_is_promoted_into_local() -> None:
    t, local, shared = tiers()
    shared.put_many(ks("s"), data("s"))        # written by another replica
    assert t.exists_many(ks("s", "none")) == [True, False]
    assert get_bytes(t, NS.key("s"), SIZE) == block_bytes("s", SIZE)
    assert local.exists_many(ks("s")) == [True]
    assert get_bytes(t, NS.key("s"), SIZE) == block_bytes("s", SIZE)
    st = t.stats()
    c = st.extra["tiers"]
    assert (c["shared_hits"], c["promotions"], c["local_hits"]) == (1, 1, 1)
    assert st.hits == 2 and st.extra["shared"]["hits"] == 1 and st.extra["local"]["hits"] == 1


def test_a_promotion_is_put_as_the_local_store_puts_on_a_read_path() -> None:
    """A local store with `promote_many` (the disk store: it waits for its index no longer than
    a read does) is given the promoted blocks through it, never through `put_many`."""
    t, local, shared = tiers()
    calls: list[str] = []
    real = local.put_many

    def promote_many(keys, blocks):  # type: ignore[no-untyped-def]
        calls.append("promote")
        return real(keys, blocks)

    local.promote_many = promote_many  # type: ignore[attr-defined]
    shared.put_many(ks("p"), data("p"))
    assert get_bytes(t, NS.key("p"), SIZE) == block_bytes("p", SIZE)
    assert calls == ["promote"] and local.exists_many(ks("p")) == [True]


def test_a_promotion_through_the_cpu_path_reaches_the_disk_stores_promotion(
        tmp_path: Path) -> None:
    """As the backend builds it (`make_tiered(open_path(cfg), ...)`): the local store is the cpu
    transfer path over a disk store, and a promoted block goes to the disk store's
    `promote_many` (the read's wait), not its `put_many`."""
    from offload.transfer.cpu_staging import CpuStagingPath

    disk = open_store(tmp_path / "local")
    calls: list[str] = []
    for name in ("put_many", "promote_many"):
        real = getattr(disk, name)
        setattr(disk, name, lambda k, b, real=real, name=name: (calls.append(name), real(k, b))[1])
    shared = FaultyMemoryStore()
    t = TieredStore(CpuStagingPath(disk), shared, WriteThrough())  # type: ignore[arg-type]
    try:
        shared.put_many(ks("q"), data("q"))
        assert get_bytes(t, NS.key("q"), SIZE) == block_bytes("q", SIZE)
        assert calls == ["promote_many"] and disk.flush() and disk.exists_many(ks("q")) == [True]
    finally:
        t.close()


def test_mixed_batch_keeps_order_and_counts_misses() -> None:
    t, local, shared = tiers()
    local.put_many(ks("l"), data("l"))
    shared.put_many(ks("s"), data("s"))
    dests = [[bytearray(SIZE)] for _ in range(3)]
    assert t.get_many(ks("s", "x", "l"), dests) == [True, False, True]
    assert bytes(dests[0][0]) == block_bytes("s", SIZE) and bytes(dests[2][0]) == \
        block_bytes("l", SIZE)
    assert t.stats().misses == 1


def test_seen_n_shares_only_blocks_seen_n_times() -> None:
    t, local, shared = tiers(SeenN(2))
    assert t.put_many(ks("once", "twice"), data("once", "twice")) == [True, True]
    assert shared.exists_many(ks("once", "twice")) == [False, False]
    t.put_many(ks("twice"), data("twice"))     # second sighting by a put
    assert shared.exists_many(ks("twice")) == [True]
    # A local hit is a sighting too: the block is copied and uploaded in the background.
    assert get_bytes(t, NS.key("once"), SIZE) == block_bytes("once", SIZE)
    t.flush()
    assert get_bytes(shared, NS.key("once"), SIZE) == block_bytes("once", SIZE)
    # Once known to be shared, further hits upload nothing.
    get_bytes(t, NS.key("once"), SIZE)
    t.flush()
    assert t.stats().extra["tiers"]["uploads_queued"] == 1


def test_shared_failures_never_fail_the_call() -> None:
    t, local, shared = tiers()
    shared.fail_writes.add(NS.key("w"))
    assert t.put_many(ks("w"), data("w")) == [True]
    assert t.stats().extra["tiers"]["shared_write_failures"] == 1
    local.fail_writes.add(NS.key("w2"))
    assert t.put_many(ks("w2"), data("w2")) == [True], "stored in the shared tier is stored"
    local.fail_writes.add(NS.key("p"))
    shared.put_many(ks("p"), data("p"))
    assert get_bytes(t, NS.key("p"), SIZE) == block_bytes("p", SIZE)
    assert t.stats().extra["tiers"]["promotion_failures"] == 1


def test_upload_queue_is_bounded() -> None:
    local, shared = MemoryStore(), MemoryStore()
    t = TieredStore(local, shared, SeenN(1), upload_queue_bytes=0)
    local.put_many(ks("q"), data("q"))
    assert get_bytes(t, NS.key("q"), SIZE) is not None
    assert t.stats().extra["tiers"]["uploads_dropped"] == 1
    t.close()


def test_delete_removes_from_both() -> None:
    t, local, shared = tiers()
    t.put_many(ks("d"), data("d"))
    assert t.delete_many(ks("d")) == 1            # one block, in both tiers
    assert t.exists_many(ks("d")) == [False]


def test_policy_and_factory_from_config() -> None:
    local = MemoryStore()
    assert make_tiered(local, load_offload({}).redis) is local
    cfg = load_offload({"redis": {"url": "redis://127.0.0.1:1", "write_policy": "seen_n",
                                  "seen_n": 3}}).redis
    p = policy_from_config(cfg)
    assert isinstance(p, SeenN) and p.n == 3
    assert [p.admit(b"k") for _ in range(4)] == [False, False, True, True]
    t = make_tiered(local, cfg)
    assert isinstance(t, TieredStore)
    t.close()


def test_disk_local_redis_shared_two_hosts(redis_server: RedisProc, tmp_path: Path) -> None:
    from offload.store.redis.store import RedisStore

    cfg = load_offload({"redis": {"url": redis_server.url, "timeout_s": 2.0}}).redis

    def host(name: str) -> TieredStore:
        disk = open_store(tmp_path / name, 64 << 20, o_direct="off")
        return TieredStore(disk, RedisStore(cfg), policy_from_config(cfg))

    a, b = host("a"), host("b")
    names = [f"d{i}" for i in range(6)]
    assert a.put_many(ks(*names), data(*names)) == [True] * 6
    dests = [[bytearray(SIZE // 2), bytearray(SIZE // 2)] for _ in names]
    assert b.get_many(ks(*names), dests) == [True] * 6
    assert [bytes(d[0]) + bytes(d[1]) for d in dests] == [x[0] for x in data(*names)]
    assert b.local.exists_many(ks(*names)) == [True] * 6, "promoted onto b's disk"
    assert b.stats().extra["tiers"]["promotions"] == 6
    a.close()
    b.close()


class _RaisingShared(MemoryStore):
    """A shared tier whose put raises (a bug, a closed client) for the first `raises` calls."""

    def __init__(self, raises: int):
        super().__init__()
        self.raises = raises

    def put_many(self, keys, blocks):  # type: ignore[no-untyped-def]
        if self.raises > 0:
            self.raises -= 1
            raise RuntimeError("shared tier exploded")
        return super().put_many(keys, blocks)


def test_an_upload_that_raises_releases_its_queued_bytes() -> None:
    """Issue 14: the queued-bytes count leaked on an exception, then every upload was dropped."""
    local, shared = MemoryStore(), _RaisingShared(raises=3)
    t = TieredStore(local, shared, SeenN(1), upload_queue_bytes=SIZE)  # room for one block
    names = [f"u{i}" for i in range(5)]
    local.put_many(ks(*names), data(*names))
    for n in names:                              # one at a time: each fits the queue alone
        assert get_bytes(t, NS.key(n), SIZE) == block_bytes(n, SIZE)
        t.flush()
    c = t.stats().extra["tiers"]
    assert c["uploads_dropped"] == 0 and c["uploads_queued"] == 5
    assert (c["shared_write_failures"], c["shared_writes"]) == (3, 2)
    assert shared.exists_many(ks(*names)) == [False] * 3 + [True] * 2
    assert t._queued_bytes == 0
    t.close()
