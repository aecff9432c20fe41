"""StoreWatch: per-tier counters from store stats (deltas, restarts), the path label, and the
metrics of a real backend (SGLang's factory, a real DiskStore) after a store and a load."""

from __future__ import annotations

import threading

import torch
from prometheus_client import REGISTRY, CollectorRegistry

from offload.metrics import StoreWatch, TierMetrics, counted_by_backend, path_of
from offload.store.base import Backlog, StoreStats
from offload.store.memory.store import MemoryStore
from offload.store.tiered import SeenN, TieredStore, WriteThrough
from tests.hicache import hicache_pools as hp


class AgentLike(MemoryStore):
    name = "dpu"        # what a TransferPath to the DPU agent reports

    def register_region(self, buffer: object) -> None:   # a TransferPath, as AgentStore
        pass

    def tier_stats(self) -> dict[str, StoreStats]:       # as AgentStore: agent-wide counters
        s = self.stats()
        s.extra["process_counters"] = ()
        return {"agent": s}


class RedisLike(MemoryStore):
    def tier_stats(self) -> dict[str, StoreStats]:       # as RedisStore: the shared tier
        return {"redis": self.stats()}


def _v(reg: CollectorRegistry, name: str, **labels: str) -> float:
    return reg.get_sample_value(name, labels) or 0.0


def _keys(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag.ljust(16, b"-") + i.to_bytes(16, "big") for i in range(n)]


def test_tiered_store_counts_local_and_redis_separately():
    local, shared = MemoryStore(), RedisLike()
    t = TieredStore(local, shared, WriteThrough())
    reg = CollectorRegistry()
    m = TierMetrics(reg)
    w = StoreWatch(t, m)
    keys = _keys(4)
    assert all(t.put_many(keys, [[b"x" * 100]] * 4))
    local.delete_many(keys[:2])                       # two only in Redis now
    assert all(t.get_many(keys, [[bytearray(100)] for _ in keys]))
    w.poll()
    assert _v(reg, "sglang_offload_hits_total", tier="local") == 2
    assert _v(reg, "sglang_offload_misses_total", tier="local") == 2
    assert _v(reg, "sglang_offload_hits_total", tier="redis") == 2
    assert _v(reg, "sglang_offload_bytes_total", tier="redis", direction="write") == 400
    w.poll()                                          # no change: no double counting
    assert _v(reg, "sglang_offload_hits_total", tier="local") == 2
    assert path_of(t) == "cpu" and set(t.tier_stats()) == {"local", "redis"}


class SlowRedis(RedisLike):
    """A shared tier whose puts wait until `gate` is set (uploads pile up behind it)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def put_many(self, keys, blocks):  # type: ignore[no-untyped-def]
        self.gate.wait(30)
        return super().put_many(keys, blocks)


def test_write_backlog_is_the_tiered_stores_queued_uploads():
    shared = SlowRedis()
    t = TieredStore(MemoryStore(), shared, SeenN(2))    # the 2nd sighting (a local hit) uploads
    reg = CollectorRegistry()
    w = StoreWatch(t, TierMetrics(reg))
    keys = _keys(3, b"b")
    assert all(t.put_many(keys, [[b"q" * 100]] * 3)) and t.backlog() == {"redis": Backlog(0, 0)}
    assert all(t.get_many(keys, [[bytearray(100)] for _ in keys]))    # three uploads queued
    assert t.backlog() == {"redis": Backlog(3, 300)}
    w.poll()
    assert _v(reg, "sglang_offload_write_backlog_pages", tier="redis") == 3
    shared.gate.set()
    assert t.flush() and t.backlog() == {"redis": Backlog(0, 0)}
    w.poll()
    assert _v(reg, "sglang_offload_write_backlog_pages", tier="redis") == 0
    assert shared.exists_many(keys) == [True] * 3


def test_counters_survive_a_store_restart():
    reg = CollectorRegistry()
    m = TierMetrics(reg)
    stores = [MemoryStore(), MemoryStore()]
    w = StoreWatch(stores[0], m, stats_of=lambda s: stores[0].tier_stats())
    keys = _keys(3)
    stores[0].put_many(keys, [[b"y"]] * 3)
    stores[0].get_many(keys, [[bytearray(1)] for _ in keys])
    w.poll()
    stores[0] = stores[1]                             # reopened: its counters start at 0
    stores[0].put_many(keys[:1], [[b"y"]])
    stores[0].get_many(keys[:1], [[bytearray(1)]])
    w.poll()
    assert _v(reg, "sglang_offload_hits_total", tier="local") == 4


def test_agent_tier_counts_are_this_process_only():
    agent = AgentLike(capacity=1 << 20)
    assert path_of(agent) == "dpu" and counted_by_backend(agent)
    reg = CollectorRegistry()
    m = TierMetrics(reg)
    keys = _keys(2)
    agent.put_many(keys, [[b"z"]] * 2)
    agent.get_many(keys, [[bytearray(1)] for _ in keys])
    StoreWatch(agent, m).poll()                       # agent-wide counters are not taken
    assert _v(reg, "sglang_offload_hits_total", tier="agent") == 0
    assert _v(reg, "sglang_offload_capacity_bytes", tier="agent") == 1 << 20
    t = TieredStore(agent, RedisLike(), WriteThrough())
    assert path_of(t) == "dpu" and not counted_by_backend(t)
    t.get_many(keys + _keys(1, b"gone"), [[bytearray(1)] for _ in range(3)])
    StoreWatch(t, m).poll()                           # the tiered store's own counters are
    assert _v(reg, "sglang_offload_hits_total", tier="agent") == 2
    assert _v(reg, "sglang_offload_misses_total", tier="agent") == 1


def test_backend_exports_load_store_path_and_tier_counters(tmp_path):
    host = hp.host_pool(hp.device_pool(), "page_first", pages=16)
    sc = hp.storage_config(hp.extra(str(tmp_path / "store")))
    b = hp.make_backend(sc, host)
    samples = [("sglang_offload_load_seconds_count", {"path": "cpu"}),
               ("sglang_offload_store_seconds_count", {"path": "cpu"}),
               ("sglang_offload_hits_total", {"tier": "local"}),
               ("sglang_offload_bytes_total", {"tier": "local", "direction": "read"})]
    before = [REGISTRY.get_sample_value(n, lab) or 0.0 for n, lab in samples]
    keys = [f"{i:064x}" for i in range(3)]
    P = hp.PAGE
    assert all(b.batch_set_v1(keys, torch.arange(0, 3 * P)))
    assert all(b.batch_get_v1(keys, torch.arange(3 * P, 6 * P)))
    b.close()                                         # the watcher's last poll
    diff = [REGISTRY.get_sample_value(n, lab) - v for (n, lab), v in zip(samples, before)]
    assert diff == [1, 1, 3, 3 * b.pages.page_bytes]
    assert REGISTRY.get_sample_value("sglang_offload_path_info", {"path": "cpu"}) == 1
    assert REGISTRY.get_sample_value("sglang_offload_read_bandwidth_bytes_per_second") > 0


def test_tier_stats_come_from_the_stores_not_their_class_names():
    class Failing(MemoryStore):
        def tier_stats(self) -> dict[str, StoreStats]:
            raise OSError("stats unavailable")

    reg = CollectorRegistry()
    StoreWatch(Failing(), TierMetrics(reg)).poll()        # a miss for the metrics, not a crash
    renamed = type("SomethingElse", (AgentLike,), {})(capacity=1 << 10)
    assert path_of(renamed) == "dpu" and counted_by_backend(renamed)
    t = TieredStore(renamed, RedisLike(), WriteThrough())
    assert set(t.tier_stats()) == {"agent", "redis"}
    assert t.tier_stats()["agent"].extra == {"process_counters": ("hits", "misses")}


def test_each_drive_of_a_spread_store_has_its_state(tmp_path):
    from offload.config import Size, StoreConfig
    from offload.store.disk.spread import SpreadStore

    dirs = [tmp_path / f"nvme{i}" for i in range(2)]
    reg = CollectorRegistry()
    with SpreadStore(StoreConfig(paths=tuple(map(str, dirs)), capacity=Size(64 << 20),
                                 min_free=Size(0)), monitor=False) as s:
        w = StoreWatch(s, TierMetrics(reg))
        w.poll()
        assert _v(reg, "sglang_offload_drive_state", drive=str(dirs[0]), state="in") == 1
        dirs[1].rename(tmp_path / "away")            # unplugged
        s.check()
        w.poll()
        assert _v(reg, "sglang_offload_drive_state", drive=str(dirs[1]), state="out") == 1
        assert _v(reg, "sglang_offload_drive_state", drive=str(dirs[1]), state="in") == 0
        assert _v(reg, "sglang_offload_drive_state", drive=str(dirs[0]), state="in") == 1
