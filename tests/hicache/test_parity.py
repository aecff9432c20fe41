"""Issue 20: what SGLang gives Mooncake, OffloadStorage gets too; SGLang's own classes on CPU.

Head-split keys (tp_lcm_size): a TP2 and a TP4 replica restore each other's pages byte-exact.
MHA draft on an MLA target at TP2: both ranks' drafts restored. clear() over every pool.
Refusals at attach for layouts we cannot serve; none escaping a late sidecar registration.
Ranks (DCP, attention CP, DP-attention metrics, the L3 layout): test_parity_ranks.py.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
hs = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from offload.errors import ConfigError  # noqa: E402
from tests.hicache import hicache_pools as hp  # noqa: E402
from tests.hicache import parity_setup as ps  # noqa: E402
from tests.hicache import pool_families as pf  # noqa: E402

PT, PN, PP = hs.PoolTransfer, hs.PoolName, hs.PoolHitPolicy
N = 4   # pages per test
pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("writer,reader", [(2, 4), (4, 2)], ids=["tp2-to-tp4", "tp4-to-tp2"])
def test_replicas_of_different_tp_sizes_restore_each_others_pages(tmp_path, writer, reader):
    """tp_lcm_size=4 on the TP2 replica (SGLang splits its heads); the TP4 one needs nothing."""
    extra = hp.extra(str(tmp_path / "kv"))
    keys = ps.keys(N)
    src = ps.replica(extra, writer, seed=11, lcm=4 if writer == 2 else None)
    for b, _ in src:
        assert b.batch_set_v1(keys, ps.idx(0, N)) == [True] * N
        assert b.plan.split == (2 if writer == 2 else 1)
        b.close()
    dst = ps.replica(extra, reader, seed=None, lcm=4 if reader == 2 else None)
    try:
        for b, _ in dst:
            assert b.batch_exists(keys) == N
            assert b.batch_get_v1(keys, ps.idx(8, N)) == [True] * N
        for head, page in itertools.product(range(ps.HEADS), range(N)):
            assert ps.head_of(dst, reader, head, 8 + page) == ps.head_of(src, writer, head, page)
        # one head group missing on disk: that page is a miss on the rank that needs it
        lost = dst[0][0].plan.keys(keys)[dst[0][0].plan.split * 2]   # page 3, first group
        dst[0][0].store.delete_many([lost])
        assert dst[0][0].batch_exists(keys) == 2
    finally:
        for b, _ in dst:
            b.close()


def test_sglangs_controller_splits_heads_for_us(tmp_path):
    """SGLang's HiCacheController at TP2 rank 1 with `tp_lcm_size` 4 in the extra config (its own
    _generate_storage_config sets should_split_heads): backup through its storage threads, then
    TP4 ranks 2 and 3 restore the two heads exactly."""
    from sglang.srt.runtime_context import get_parallel

    from tests.hicache import controller_harness as ch

    ch.init_runtime()
    kv = ps.mha_device_pool(2)
    pool = hp.host_pool(kv, "page_head", 16)
    extra = hp.extra(str(tmp_path / "kv"))
    rank1 = dict(tp_size=2, tp_rank=1, attn_tp_size=2, attn_tp_rank=1, moe_tp_size=2,
                 moe_tp_rank=1)
    with get_parallel().override(**rank1):
        ctrl = ch.make_controller(kv, pool, {**extra, "tp_lcm_size": 4})
    try:
        assert ctrl.storage_config.should_split_heads
        assert ctrl.storage_backend.plan.head_groups == [2, 3]
        hp.fill(pool, 9)
        src = pool.alloc(N * ps.PAGE)
        tokens = list(range(100, 100 + N * ps.PAGE))
        assert ch.backup(ctrl, src, tokens) == len(tokens)
        pages = [int(src[i * ps.PAGE]) // ps.PAGE for i in range(N)]
        want = {h: [ps.head_bytes(pool, p, h) for p in pages] for h in (0, 1)}
    finally:
        ctrl.detach_storage_backend()
    keys = ch.page_hashes(tokens)
    for head in (0, 1):
        dst = ps.mha_head_pool(1)
        sc = ps.storage_config(extra, tp_rank=2 + head, tp_size=4, layout="page_head")
        b = ps.attach(sc, dst)
        try:
            assert b.batch_get_v1(keys, ps.idx(4, N)) == [True] * N
            assert [ps.head_bytes(dst, 4 + i, 0) for i in range(N)] == want[head]
        finally:
            b.close()


def test_head_split_legacy_flat_pages_are_the_same_blocks(tmp_path):
    """SGLang's copying interface (batch_set/batch_get of flat pages) writes the same objects."""
    extra = hp.extra(str(tmp_path / "kv"))
    keys = ps.keys(2)
    (b2, p2), = ps.replica(extra, 1, seed=3, lcm=2)   # TP1 split in 2 groups
    assert b2.batch_set(keys, [p2.get_data_page(i * ps.PAGE) for i in range(2)])
    b2.close()
    tp2 = ps.replica(extra, 2, seed=None, lcm=None)
    try:
        for b, _ in tp2:
            assert b.batch_get_v1(keys, ps.idx(5, 2)) == [True, True]
        for head, page in itertools.product(range(ps.HEADS), range(2)):
            assert ps.head_of(tp2, 2, head, 5 + page) == ps.head_of([(None, p2)], 1, head, page)
    finally:
        for b, _ in tp2:
            b.close()


def test_a_split_the_pool_cannot_serve_is_refused_at_attach(tmp_path):
    pool = ps.mha_head_pool(2, layout="page_first")
    sc = ps.storage_config(hp.extra(str(tmp_path)), tp_size=2, layout="page_head", tp_lcm_size=4)
    with pytest.raises(ConfigError, match=r"tp_lcm_size: 4 at TP 2 .*layout 'page_first'"):
        ps.attach(sc, pool)
    odd = ps.mha_head_pool(1)
    sc = ps.storage_config(hp.extra(str(tmp_path)), tp_size=2, layout="page_head", tp_lcm_size=4)
    with pytest.raises(ConfigError, match=r"1 KV heads per rank, not divisible by the split 2"):
        ps.attach(sc, odd)


def test_page_first_kv_split_is_refused_clearly(tmp_path):
    """Ascend's MLA layout (K and V in separate buffers; NPU-only, so a CPU pool is relabelled)."""
    pool = hp.host_pool(hp.device_pool(mla=True), "page_first", 8)
    pool.layout = "page_first_kv_split"
    sc = ps.storage_config(hp.extra(str(tmp_path)), mla=True)
    with pytest.raises(ConfigError, match=r"--hicache-mem-layout: 'page_first_kv_split' .*allowed: "
                                          r"layer_first, page_first, page_first_direct, page_head"):
        ps.attach(sc, pool)


def _draft_rank(extra: dict, rank: int, seed: int | None) -> tuple:
    anchor = hp.host_pool(hp.device_pool(mla=True), "page_first", pf.PAGES)
    draft = pf._mha(1, "page_first")
    if seed is not None:
        pf.fill_any(anchor, 1)
        pf.fill_any(draft, seed)
    sc = ps.storage_config(extra, mla=True, tp_rank=rank, tp_size=2)
    return ps.attach(sc, anchor, {PN.DRAFT: draft}), anchor, draft


def _draft_io(keys: list[str], first: int) -> list:
    return [PT(name=PN.DRAFT, host_indices=ps.idx(first, len(keys)), keys=keys,
               hit_policy=PP.ALL_PAGES, indices_from_pool=PN.KV)]


def test_mha_draft_on_an_mla_target_at_tp2_restores_both_ranks(tmp_path):
    extra = hp.extra(str(tmp_path / "kv"))
    keys = ps.keys(N)
    ranks = [_draft_rank(extra, r, seed=20 + r) for r in (0, 1)]
    want = []
    for r, (b, anchor, draft) in enumerate(ranks):
        assert b.is_writer == (r == 0)
        assert b.pools["draft"].writes                       # the non-writer rank too
        if b.is_writer:                                      # the shared MLA KV: rank 0
            assert b.batch_set_v1(keys, ps.idx(0, N)) == [True] * N
        assert b.batch_set_v2(_draft_io(keys, 0))[PN.DRAFT] == [True] * N
        want.append([pf.page_of(draft, i * ps.PAGE) for i in range(N)])
    assert want[0] != want[1]
    for b, *_ in ranks:
        b.close()
    fresh = [_draft_rank(extra, r, seed=None) for r in (0, 1)]
    try:
        for r, (b, anchor, draft) in enumerate(fresh):
            q = [PT(name=PN.DRAFT, keys=keys, hit_policy=PP.ALL_PAGES, indices_from_pool=PN.KV)]
            assert b.batch_exists_v2(keys, q).restorable_prefix_pages == list(range(1, N + 1))
            assert b.batch_get_v2(_draft_io(keys, 8))[PN.DRAFT] == [True] * N
            assert [pf.page_of(draft, (8 + i) * ps.PAGE) for i in range(N)] == want[r]
    finally:
        for b, *_ in fresh:
            b.close()


def test_sglang_backs_the_draft_up_on_every_rank_for_us(tmp_path):
    """HybridCacheController.should_backup (patches/0011) on the non-writer rank 1."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    extra = hp.extra(str(tmp_path))
    draft = pf._mha(1, "page_first")
    ctrl = SimpleNamespace(backup_skip=True, storage_backend_type="dynamic",
                           storage_config=ps.storage_config(extra, mla=True, tp_rank=1,
                                                            tp_size=2),
                           mem_pool_host=SimpleNamespace(
                               entry_map={PN.DRAFT: SimpleNamespace(host_pool=draft)}))
    assert HybridCacheController.should_backup(ctrl, PT(name=PN.DRAFT))
    assert not HybridCacheController.should_backup(ctrl, PT(name=PN.INDEXER))
    ctrl.storage_backend_type = "file"
    assert not HybridCacheController.should_backup(ctrl, PT(name=PN.DRAFT))


def test_an_sglang_without_the_draft_patch_is_refused_at_attach(tmp_path, monkeypatch):
    """Stock SGLang never asks rank 1 for the draft: fail closed instead of a dead tier."""
    from offload.hicache import pools

    assert pools.sglang_backs_up_sharded_drafts()            # the patched wheel in .venv
    monkeypatch.setattr(pools, "sglang_backs_up_sharded_drafts", lambda: False)
    anchor = hp.host_pool(hp.device_pool(mla=True), "page_first", 8)
    b = hp.make_backend(ps.storage_config(hp.extra(str(tmp_path)), mla=True, tp_rank=1,
                                          tp_size=2), anchor)
    try:
        with pytest.raises(ConfigError, match=r"pool 'draft' \(MHATokenToKVPoolHost\).*0011"):
            b.register_mem_host_pool_v2(pf._mha(1, "page_first"), PN.DRAFT)
    finally:
        b.close()


def test_a_late_sidecar_that_cannot_be_stored_is_a_miss_not_an_error(tmp_path, caplog):
    b, anchor, draft = _draft_rank(hp.extra(str(tmp_path)), 0, seed=None)
    odd = pf._mha(1, "page_first")
    odd.layout = "page_first_kv_split"
    try:
        b.register_mem_host_pool_v2(odd, PN.DRAFT_SWA)      # after the attach: logged only
        assert "draft_swa" not in b.pools and "is not stored" in caplog.text
        tr = [PT(name=PN.DRAFT_SWA, host_indices=ps.idx(0, 1), keys=ps.keys(1))]
        assert b.batch_set_v2(tr) == {PN.DRAFT_SWA: [False]}
    finally:
        b.close()
    anchor = hp.host_pool(hp.device_pool(mla=True), "page_first", 8)
    sc = ps.storage_config(hp.extra(str(tmp_path)), mla=True)
    early = hp.make_backend(sc, anchor)
    try:
        with pytest.raises(ConfigError, match="draft_swa"):   # during the attach: refused
            early.register_mem_host_pool_v2(odd, PN.DRAFT_SWA)
    finally:
        early.close()


@pytest.mark.parametrize("family", ["draft", "mamba", "dsv4"])
def test_clear_leaves_no_block_of_any_pool(tmp_path, family):
    from tests.hicache.pool_io import attach, transfers, write

    backend, anchor, pools = attach(family, hp.extra(str(tmp_path / "kv")))
    keys = ps.keys(N)
    try:
        write(backend, anchor, pools, keys)
        every = backend.block_keys(keys) + [k for p in backend.pools.values() for k in p.keys(keys)]
        assert any(backend.store.exists_many(every))
        assert backend.clear() is True
        assert not any(backend.store.exists_many(every))
        res = backend.batch_exists_v2(keys, transfers(pools, keys, 0, query=True))
        assert res.restorable_prefix_pages == []
    finally:
        backend.close()


def test_head_groups_are_sglangs_unified_key_coordinates(tmp_path):
    """Our head-split objects are the `_H{g}` objects of SGLang's unified key scheme
    (hicache_key_scheme.plan_unified_kv, head_group = total heads / tp_lcm_size): same absolute
    group index, same local heads, so adopting the scheme changes names, not the split."""
    from sglang.srt.mem_cache.hicache_key_scheme import plan_unified_kv

    tp2 = ps.replica(hp.extra(str(tmp_path / "kv")), 2, seed=None, lcm=4)
    try:
        for r, (b, pool) in enumerate(tp2):
            plan = plan_unified_kv(model_id="test/model", dtype="bfloat16", page_size=ps.PAGE,
                                   rank_replicated=False, local_kv_heads=pool.head_num,
                                   attn_tp_rank=r, attn_tp_size=2, attn_cp_size=1,
                                   start_layer=0, end_layer=ps.LAYERS, is_final_stage=True,
                                   head_group=ps.HEADS // 4)
            assert b.plan.head_groups == [int(x.rsplit("_H", 1)[1]) for x in plan.suffixes]
            assert plan.head_ranges == [(g, g + 1) for g in range(b.plan.split)]
    finally:
        for b, _ in tp2:
            b.close()
