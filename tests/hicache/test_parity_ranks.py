"""Issue 20, ranks: decode context parallel, one writer per attention-CP shard, metrics ports
across DP-attention groups, and the L3 object-layout handshake; SGLang's own classes on CPU
(with the patched SGLang of patches/0010-0015)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
hs = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from offload.errors import ConfigError  # noqa: E402
from offload.hicache.keying import storage_writer  # noqa: E402
from tests.hicache import hicache_pools as hp  # noqa: E402
from tests.hicache import parity_setup as ps  # noqa: E402
from tests.store import redis_fixtures  # noqa: E402

N = 4   # pages per test
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_decode_context_parallel_shards_round_trip(tmp_path):
    """DCP 2 (patches/0012 admits us): each shard its own namespace, logical host indices."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    extra = hp.extra(str(tmp_path / "kv"))
    assert StorageBackendFactory.has_capability("dynamic", extra, "dcp")
    keys, step = ps.keys(N), 2 * ps.PAGE

    def rank(r: int, seed: int | None) -> tuple:
        pool = ps.mla_dcp_pool(r)
        if seed is not None:
            hp.fill(pool, seed)
        sc = ps.storage_config(extra, mla=True, tp_rank=r, tp_size=2, dcp=(r, 2))
        return ps.attach(sc, pool), pool

    src = [rank(r, 30 + r) for r in (0, 1)]
    assert src[0][0].namespace != src[1][0].namespace
    want = []
    for b, pool in src:
        assert b.is_writer and b.pages.index_step == step
        assert b.batch_set_v1(keys, ps.idx(0, N, step)) == [True] * N
        want.append([hp.page_bytes(pool, i * step) for i in range(N)])
        b.close()
    dst = [rank(r, None) for r in (0, 1)]
    try:
        for r, (b, pool) in enumerate(dst):
            assert b.batch_exists(keys) == N
            assert b.batch_get_v1(keys, ps.idx(3, N, step)) == [True] * N
            assert [hp.page_bytes(pool, (3 + i) * step) for i in range(N)] == want[r]
    finally:
        for b, _ in dst:
            b.close()


def test_sglangs_controller_attaches_us_under_dcp(tmp_path):
    """HiCacheController.attach_storage_backend with attn_dcp_size 2 (refused for any backend
    but file and Mooncake without patches/0012)."""
    from sglang.srt.runtime_context import get_parallel

    from tests.hicache import controller_harness as ch

    ch.init_runtime()
    dcp = dict(attn_dcp_size=2, attn_dcp_rank=0, tp_size=2, tp_rank=0, attn_tp_size=2,
               attn_tp_rank=0, moe_tp_size=2, moe_tp_rank=0)
    with get_parallel().override(**dcp):
        ctrl = ch.make_controller(hp.device_pool(mla=True), ps.mla_dcp_pool(0),
                                  hp.extra(str(tmp_path / "kv")))
    try:
        assert ctrl.storage_config.dcp_size == 2
        assert ";dcp=0/2;" in ctrl.storage_backend.namespace.extra
    finally:
        ctrl.detach_storage_backend()


CP_CASES = [  # (tp_rank, tp_size, cp_rank, cp_size, dp_attention, writer)
    (0, 4, 0, 2, False, True), (1, 4, 0, 2, False, False),
    (2, 4, 1, 2, False, True), (3, 4, 1, 2, False, False),   # SGLang's rule: rank 0 only
    (0, 2, 1, 2, True, True), (1, 2, 1, 2, True, False),     # DP attention: tp is attn-TP
]


@pytest.mark.parametrize("tp_rank,tp_size,cp_rank,cp_size,dp_attn,writer", CP_CASES)
def test_one_writer_per_attention_cp_shard(tmp_path, tp_rank, tp_size, cp_rank, cp_size,
                                           dp_attn, writer):
    sc = ps.storage_config({}, mla=True, tp_rank=tp_rank, tp_size=tp_size,
                           cp=(cp_rank, cp_size))
    assert storage_writer(sc, dp_attn) is writer


def test_sglang_backs_up_cp_shard_1_for_us(tmp_path):
    """HiCacheController.backup_skip (patches/0014) asks the backend; SGLang's own rule would
    skip CP shard 1 (global TP rank 2 of 4, attention CP 2, no DP attention)."""
    from sglang.srt.managers.cache_controller import HiCacheController

    extra = hp.extra(str(tmp_path / "kv"))
    keys = ps.keys(2)
    shards = []
    for cp_rank, tp_rank in ((0, 0), (1, 2)):
        pool = hp.host_pool(hp.device_pool(mla=True), "page_first", 8)
        hp.fill(pool, 40 + cp_rank)
        sc = ps.storage_config(extra, mla=True, tp_rank=tp_rank, tp_size=4, cp=(cp_rank, 2))
        shards.append((ps.attach(sc, pool), sc))
    try:
        b1, sc1 = shards[1]
        assert not sc1.is_storage_writer                   # SGLang's rule: shard 1 never written
        ctrl = SimpleNamespace(storage_backend=b1, storage_backend_type="dynamic",
                               storage_config=sc1)
        assert HiCacheController.backup_skip.fget(ctrl) is False
        assert shards[0][0].namespace != b1.namespace
        for b, _ in shards:
            assert b.batch_set_v1(keys, ps.idx(0, 2)) == [True, True]
            assert b.batch_exists(keys) == 2
    finally:
        for b, _ in shards:
            b.close()


def test_dp_attention_groups_export_metrics_on_distinct_ports(tmp_path):
    """Two DP-attention groups of one rank each: the same attention-local TP rank 0."""
    pytest.importorskip("prometheus_client")
    import urllib.request

    port = redis_fixtures.free_port(also=1)   # p and p + 1 free
    from sglang.srt.runtime_context import get_parallel

    extra = hp.extra(str(tmp_path / "kv"), metrics={"port": port})
    ports = []
    for group in (0, 1):
        with get_parallel().override(tp_size=2, tp_rank=group, pp_rank=0, attn_dp_size=2,
                                     attn_dp_rank=group, attn_tp_size=1, attn_tp_rank=0,
                                     moe_tp_size=2, moe_tp_rank=group):
            pool = hp.host_pool(hp.device_pool(), "page_first", 8)
            b = ps.attach(ps.storage_config(extra, dp_rank=group), pool)
        ports.append(b.metrics_port)
        b.close()
    assert ports == [port, port + 1]
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert b"sglang_offload" in r.read()


def test_l3_object_layout_is_the_same_on_every_rank(tmp_path):
    """The handshake (patches/0013): every TP rank describes every rank's namespaces, so
    SGLang's merge_l3_layouts keeps it enabled (Mooncake disables MHA layouts)."""
    extra = hp.extra(str(tmp_path / "kv"))
    tp2 = ps.replica(extra, 2, seed=None, lcm=4)
    try:
        layouts = [b.describe_l3_object_layout(sidecar_pool_specs=(), swa_trailing_pages=None,
                                               page_size=ps.PAGE) for b, _ in tp2]
        merged = hs.merge_l3_layouts(layouts)
        assert merged["enabled"] and merged["backend"] == "offload"
        (kv,) = merged["hicache_object_layout"]["pools"]
        assert kv["namespaces"] == [d.hex() for b, _ in tp2 for d in b.plan.digests]
        assert len(kv["namespaces"]) == 4                 # one per head group of tp_lcm_size
        # SGLang's own scheduler asks us (without patches/0013: "Mooncake storage is not attached")
        from sglang.srt.managers.scheduler import Scheduler

        b = tp2[1][0]
        ctrl = SimpleNamespace(storage_backend=b, storage_backend_type="dynamic",
                               storage_config=b.storage_config)
        sched = SimpleNamespace(enable_hierarchical_cache=True, page_size=ps.PAGE,
                                tree_cache=SimpleNamespace(cache_controller=ctrl))
        assert Scheduler._hicache_l3_layout(sched) == layouts[1]
    finally:
        for b, _ in tp2:
            b.close()


@pytest.mark.parametrize("family", ["swa", "mamba", "indexer"])
def test_l3_layout_with_sidecars_merges_across_ranks(tmp_path, family):
    from tests.hicache.pool_io import attach

    extra = hp.extra(str(tmp_path / "kv"))
    ranks = [attach(family, extra, tp_rank=r, tp_size=2)[0] for r in (0, 1)]
    try:
        layouts = [b.describe_l3_object_layout(sidecar_pool_specs=(), swa_trailing_pages=2,
                                               page_size=b.mem_pool_host.page_size)
                   for b in ranks]
        merged = hs.merge_l3_layouts(layouts)
        assert merged["enabled"], merged
        by_pool = {p["pool"]: p for p in merged["hicache_object_layout"]["pools"]}
        for b in ranks:
            pool = next(iter(b.pools.values()))
            assert pool.digest.hex() in by_pool[pool.name]["namespaces"]
            assert b.namespace.digest().hex() in by_pool["kv"]["namespaces"]
    finally:
        for b in ranks:
            b.close()


def test_mla_host_dedup_replica_reports_the_source_ranks_blocks(tmp_path):
    """MLA host dedup (patches/0015 admits us): rank 1's host pool has no buffer; it reports
    what rank 0 stored and moves no bytes (rank 0 loads and broadcasts them)."""
    from sglang.srt.mem_cache.mla_host_dedup import storage_supports_host_dedup

    extra = hp.extra(str(tmp_path / "kv"))
    assert storage_supports_host_dedup("dynamic", extra) and storage_supports_host_dedup("offload")
    src = hp.host_pool(hp.device_pool(mla=True), "page_first", 8)
    hp.fill(src, 50)
    keys = ps.keys(N)
    b0 = ps.attach(ps.storage_config(extra, mla=True, tp_rank=0, tp_size=2), src)
    empty = ps.mla_allocator_only_pool(src)
    assert empty.kv_buffer is None
    b1 = ps.attach(ps.storage_config(extra, mla=True, tp_rank=1, tp_size=2), empty)
    try:
        assert b1.namespace == b0.namespace and not b1.state.logical_anchor
        assert b1.batch_get_v1(keys, ps.idx(0, N)) == [False] * N
        assert b0.batch_set_v1(keys[:3], ps.idx(0, 3)) == [True] * 3
        hp.durable(b0)
        assert b1.batch_exists(keys) == 3
        assert b1.batch_get_v1(keys, ps.idx(4, N)) == [True, True, True, False]
        assert b1.batch_set_v1(keys, ps.idx(4, N)) == [True, True, True, False]
    finally:
        b0.close()
        b1.close()
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    writer = StorageBackendFactory.create_backend(
        "dynamic", ps.storage_config(extra, mla=True, tp_rank=0, tp_size=2), empty)
    try:
        with pytest.raises(ConfigError, match="has no buffer, but this rank is the storage writer"):
            writer.register_mem_pool_host(empty)
    finally:
        writer.close()
