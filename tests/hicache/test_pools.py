"""SGLang's v2 (pool) interface of OffloadStorage with SGLang's own host pool classes on CPU.

For each family (KV + DRAFT, MLA + INDEXER, MHA + MAMBA, MHA + SWA, DeepSeek-V4's logical anchor):
write through the calls SGLang's controllers make (v1 for KV, batch_set_v2 for the sidecars),
restart the backend, query batch_exists_v2, read back with batch_get_v2 into other host pages:
byte-identical. Then the rules: per-rank MAMBA under MLA, shared INDEXER, refusal at attach,
damaged and evicted sidecars, the worth-it cut, nothing raising into SGLang.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
hs = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from tests.agent.conftest import agent_factory  # noqa: E402,F401
from tests.hicache import hicache_pools as hp  # noqa: E402
from tests.hicache import pool_families as pf  # noqa: E402
from tests.hicache.pool_io import attach, transfers, write  # noqa: E402
from tests.store.redis_fixtures import redis_factory, redis_server  # noqa: E402,F401
from tests.store.stores import corrupt_block  # noqa: E402

PT, PN, PP = hs.PoolTransfer, hs.PoolName, hs.PoolHitPolicy
N = 6   # pages written per test


def _keys(n: int = N, tag: str = "") -> list[str]:
    return [f"{tag}{i:060x}".rjust(64, "0") for i in range(1, n + 1)]


def _snapshot(pools: dict, transfers: list[Any]) -> dict:
    return {t.name: [pf.page_of(pools[t.name][0], int(i)) for i in
                     t.host_indices[::pools[t.name][0].page_size].tolist()] for t in transfers}


def _store_extra(kind: str, tmp_path, request) -> dict:
    if kind == "disk":
        return hp.extra(str(tmp_path / "kv"))
    if kind == "redis":
        pytest.importorskip("redis")
        srv = request.getfixturevalue("redis_server")
        return hp.extra(str(tmp_path / "kv"), redis={"url": srv.url, "timeout_s": 2.0})
    raise ValueError(kind)


@pytest.mark.parametrize("family", pf.FAMILIES)
@pytest.mark.parametrize("tier", ["disk", pytest.param("redis", marks=pytest.mark.slow)])   # redis: slow
def test_family_round_trip_across_a_restart(family, tier, tmp_path, request):
    extra = _store_extra(tier, tmp_path, request)
    backend, anchor, pools = attach(family, extra)
    keys = _keys()
    try:
        write(backend, anchor, pools, keys)
        want = _snapshot(pools, transfers(pools, keys, 0))
    finally:
        backend.close()
    if tier == "redis":   # the Redis tier alone must serve: drop the local disk
        import shutil

        shutil.rmtree(tmp_path / "kv")
    backend, anchor, pools = attach(family, extra)   # a new process: fresh, zeroed pools
    try:
        res = backend.batch_exists_v2(keys, transfers(pools, keys, 0, query=True))
        trailing = any(t for *_, t in pools.values())   # a window only at the end: N alone
        assert res.kv_hit_pages == N
        assert res.restorable_prefix_pages == ([N] if trailing else list(range(1, N + 1)))
        tr = transfers(pools, keys, 8)
        got = backend.batch_get_v2(tr)
        assert all(v == [True] * len(t.keys) for t, v in zip(tr, got.values()))
        assert _snapshot(pools, tr) == want
    finally:
        backend.close()


def test_trailing_pool_restorable_lengths_have_holes(tmp_path):
    """MAMBA (1 trailing page) stored at pages 3 and 6 only: restorable are exactly 3 and 6."""
    backend, anchor, pools = attach("mamba", hp.extra(str(tmp_path)))
    keys = _keys()
    try:
        pf.fill_any(anchor, 1)
        assert backend.batch_set_v1(keys, torch.arange(0, N * hp.PAGE)) == [True] * N
        for end in (3, 6):
            res = backend.batch_set_v2([PT(name=PN.MAMBA, host_indices=torch.tensor([end]),
                                           keys=[keys[end - 1]])])
            assert res[PN.MAMBA] == [True]
        q = [PT(name=PN.MAMBA, keys=[keys[-1]], hit_policy=PP.TRAILING_PAGES)]
        res = backend.batch_exists_v2(keys, q)
        assert res.restorable_prefix_pages == [3, 6] and res.kv_hit_pages == 6
        assert res.extra_pool_hit_pages == {PN.KV: 6, PN.MAMBA: 6}
    finally:
        backend.close()


def test_sidecar_never_inferred_from_kv_and_eviction_is_a_gap(tmp_path):
    backend, anchor, pools = attach("indexer", hp.extra(str(tmp_path)))
    keys = _keys()
    try:
        write(backend, anchor, pools, keys)
        extra_keys = _keys(8)
        pf.fill_any(anchor, 2)   # two more KV pages, written without their indexer pages
        backend.batch_set_v1(extra_keys[N:], torch.arange(N * 64, 8 * 64))
        q = transfers(pools, extra_keys, 0, query=True)
        res = backend.batch_exists_v2(extra_keys, q)
        assert res.kv_hit_pages == N and res.extra_pool_hit_pages[PN.KV] == 8
        # evict the indexer page of page 3: exists sees the gap at once
        pool = backend.pools["indexer"]
        assert backend.store.delete_many(pool.keys([keys[2]])) == 1
        res = backend.batch_exists_v2(keys, q)
        assert res.kv_hit_pages == 2 and res.restorable_prefix_pages == [1, 2]
    finally:
        backend.close()


def test_damaged_sidecar_page_stops_the_restorable_prefix(tmp_path):
    store_dir = str(tmp_path / "kv")
    backend, anchor, pools = attach("draft", hp.extra(store_dir))
    keys = _keys()
    try:
        write(backend, anchor, pools, keys)
        bad = backend.pools["draft"].keys([keys[3]])[0]
    finally:
        backend.close()
    assert corrupt_block(store_dir, bad)
    backend, anchor, pools = attach("draft", hp.extra(store_dir))
    try:
        tr = transfers(pools, keys, 8)
        got = backend.batch_get_v2(tr)[PN.DRAFT]
        assert got == [True, True, True, False, True, True]   # never served, counted as a miss
        assert hs.count_pool_hits({"draft": got}) == {"draft": 3}
        res = backend.batch_exists_v2(keys, transfers(pools, keys, 0, query=True))
        assert res.restorable_prefix_pages == [1, 2, 3]      # the bad block was deleted
    finally:
        backend.close()


def test_mla_ranks_share_the_indexer_and_own_their_mamba_state(tmp_path):
    """Rank 0 writes the shared INDEXER; rank 1 (non-writer) writes nothing shared, but its
    own MAMBA pool is really written, under its own namespace."""
    extra = hp.extra(str(tmp_path))
    b0, a0, p0 = attach("indexer", extra, tp_rank=0, tp_size=2)
    b1, a1, p1 = attach("indexer", extra, tp_rank=1, tp_size=2)
    m0, m1 = pf._mamba(), pf._mamba()
    b0.register_mem_host_pool_v2(m0, PN.MAMBA)   # a dynamic sidecar, after the attach
    b1.register_mem_host_pool_v2(m1, PN.MAMBA)
    keys = _keys(2)
    try:
        assert b1.pools["indexer"].digest == b0.pools["indexer"].digest
        assert b1.pools["mamba"].digest != b0.pools["mamba"].digest
        assert b1.batch_set_v2(transfers(p1, keys, 0))[PN.INDEXER] == [False, False]
        write(b0, a0, p0, keys)
        hp.durable(b0)
        assert b1.batch_set_v2(transfers(p1, keys, 0))[PN.INDEXER] == [True, True]
        pf.fill_any(m1, 9)
        mt = [PT(name=PN.MAMBA, host_indices=torch.tensor([4]), keys=[keys[-1]],
                 hit_policy=PP.TRAILING_PAGES)]
        assert b1.batch_set_v2(mt)[PN.MAMBA] == [True]          # the non-writer really writes
        q = transfers(p0, keys, 0, query=True) + [
            PT(name=PN.MAMBA, keys=[keys[-1]], hit_policy=PP.TRAILING_PAGES)]
        assert b1.batch_exists_v2(keys, q).restorable_prefix_pages == [2]
        assert b0.batch_exists_v2(keys, q).restorable_prefix_pages == []   # rank 0 has no state
    finally:
        b0.close()
        b1.close()


def test_worth_it_cuts_the_final_count_and_the_restorable_lengths(tmp_path):
    extra = hp.extra(str(tmp_path), worth_it={"prefill_tokens_per_s": 1e12})
    backend, anchor, pools = attach("swa", extra)
    keys = _keys()
    try:
        write(backend, anchor, pools, keys)
        backend.worth.observe(1, 1.0)   # a tier at 1 byte/s: never worth loading
        res = backend.batch_exists_v2(keys, transfers(pools, keys, 0, query=True))
        assert res.kv_hit_pages == 0 and res.restorable_prefix_pages == []
    finally:
        backend.close()


class _Broken:
    def __getattr__(self, name: str) -> Any:
        def fail(*_a: Any, **_k: Any) -> Any:
            raise OSError("disk gone")
        return fail


def test_no_v2_call_raises_into_sglang(tmp_path):
    backend, anchor, pools = attach("mamba", hp.extra(str(tmp_path)))
    keys = _keys(2)
    real = backend.store
    backend.store = _Broken()
    try:
        tr = transfers(pools, keys, 0)
        assert backend.batch_set_v2(tr) == {PN.MAMBA: [False]}
        assert backend.batch_get_v2(tr) == {PN.MAMBA: [False]}
        res = backend.batch_exists_v2(keys, transfers(pools, keys, 0, query=True))
        assert res.kv_hit_pages == 0 and not res.restorable_prefix_pages
        bad = [PT(name=PN.MAMBA, host_indices=torch.arange(3), keys=keys)]   # wrong length
        backend.store = real
        assert backend.batch_get_v2(bad) == {PN.MAMBA: [False, False]}
        assert backend.batch_get_v2([PT(name="nope", host_indices=torch.arange(1),
                                        keys=keys[:1])]) == {"nope": [False]}
    finally:
        backend.store = real
        backend.close()


def test_pool_namespaces_are_described_for_cache_stats(tmp_path):
    from offload.commands.cache import describe
    from offload.store.factory import open_existing

    backend, anchor, pools = attach("mamba", hp.extra(str(tmp_path)))
    try:
        write(backend, anchor, pools, _keys(2))
    finally:
        backend.close()
    store = open_existing(str(tmp_path))
    try:
        nss = store.summary()["namespaces"]
    finally:
        store.close()
    assert {(n["description"] or {}).get("pool", "") for n in nss} == {"", "mamba"}
    lines = sorted(describe(n["description"]) for n in nss)
    assert lines[0].startswith("KV pages,") and lines[1].startswith("pool mamba (Mamba")


def test_kv_digests_did_not_change():
    """Caches written before pools existed stay readable: "pool" is left out when empty."""
    from offload.keys import Namespace

    assert b'"pool"' not in Namespace("m", "bf16", "page_first", 16).canonical()
    assert b'"pool":"swa"' in Namespace("m", "bf16", "page_first", 16, pool="swa").canonical()


def test_pools_through_the_dpu_agent(request, tmp_path, monkeypatch):
    """dpu path: a real agent process; the DRAFT pool (one contiguous tensor) moves by NIXL,
    MAMBA state (several tensors, copied) inline; both byte-identical after a reconnect."""
    from tests.agent.conftest import SECRET, nixl_available

    if not nixl_available():
        pytest.skip("NIXL is not installed")
    agent = request.getfixturevalue("agent_factory")("--memory")
    monkeypatch.setenv("SGLANG_OFFLOAD_SECRET", SECRET.decode())
    extra = hp.extra(str(tmp_path / "unused"), transfer={"path": "dpu"},
                     agent={"address": agent.address, "transport": "ucx", "timeout_s": 5})
    keys = _keys()
    for family in ("draft", "mamba"):
        backend, anchor, pools = attach(family, extra)
        try:
            write(backend, anchor, pools, keys)
            want = _snapshot(pools, transfers(pools, keys, 0))
        finally:
            backend.close()
        backend, anchor, pools = attach(family, extra)
        try:
            res = backend.batch_exists_v2(keys, transfers(pools, keys, 0, query=True))
            assert res.kv_hit_pages == N
            tr = transfers(pools, keys, 8)
            assert all(all(v) for v in backend.batch_get_v2(tr).values())
            assert _snapshot(pools, tr) == want
        finally:
            backend.close()


def test_metrics_label_the_pool(tmp_path):
    pytest.importorskip("prometheus_client")
    from prometheus_client import REGISTRY

    def pages(pool: str, direction: str) -> float:
        return REGISTRY.get_sample_value("sglang_offload_pool_pages_total",
                                         {"pool": pool, "direction": direction}) or 0.0

    before = {(p, d): pages(p, d) for p in ("kv", "draft") for d in ("read", "write")}
    backend, anchor, pools = attach("draft", hp.extra(str(tmp_path / "kv")))
    keys = _keys()
    try:
        write(backend, anchor, pools, keys)
        tr = [t for t in transfers(pools, keys, 8) if str(t.name) != "kv"]
        backend.batch_get_v2(tr)
    finally:
        backend.close()
    assert pages("kv", "write") - before["kv", "write"] == N
    assert pages("draft", "write") - before["draft", "write"] == N
    assert pages("draft", "read") - before["draft", "read"] == N
