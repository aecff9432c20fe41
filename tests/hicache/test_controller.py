"""OffloadStorage driven by SGLang's own HiCacheController (its storage threads) on CPU.

write_storage -> prefetch hit query -> load back, byte-identical, for every host layout, MHA and
MLA; a corrupted block on disk is a miss through the whole path.
"""

from __future__ import annotations

import pytest

from offload.keys import block_key
from tests.hicache import controller_harness as ch
from tests.hicache import hicache_pools as hp
from tests.store.stores import corrupt_block

pytestmark = pytest.mark.timeout(120)


def _setup(tmp_path, layout: str, mla: bool):
    kv = hp.device_pool(mla)
    host = hp.host_pool(kv, layout, pages=32)
    ctrl = ch.make_controller(kv, host, hp.extra(str(tmp_path / "store")))
    return kv, host, ctrl


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", hp.LAYOUTS)
def test_backup_then_prefetch_is_byte_identical(tmp_path, layout, mla):
    _, host, ctrl = _setup(tmp_path, layout, mla)
    try:
        backend = ctrl.storage_backend
        assert type(backend).__name__ == "OffloadStorage"
        assert ctrl.page_set_func == ctrl._page_set_zero_copy  # interface_v1 honoured
        assert backend.pages.zero_copy
        hp.fill(host, seed=7)
        n_pages = 6
        src = host.alloc(n_pages * hp.PAGE)
        tokens = list(range(1000, 1000 + n_pages * hp.PAGE))
        want = [hp.page_bytes(host, int(src[i * hp.PAGE])) for i in range(n_pages)]

        assert ch.backup(ctrl, src, tokens) == len(tokens)
        hits, loaded, dst = ch.prefetch(ctrl, host, tokens + [1, 2, 3])
        assert hits == loaded == len(tokens)
        assert not set(dst.tolist()) & set(src.tolist())
        got = [hp.page_bytes(host, int(dst[i * hp.PAGE])) for i in range(n_pages)]
        assert got == want

        # A different prompt is a miss; a shared prefix is a partial hit.
        assert ch.prefetch(ctrl, host, list(range(5, 5 + 4 * hp.PAGE)), rid="other")[0] == 0
        other = tokens[: 2 * hp.PAGE] + list(range(9, 9 + 2 * hp.PAGE))
        assert ch.prefetch(ctrl, host, other, rid="partial")[:2] == (2 * hp.PAGE, 2 * hp.PAGE)

        m = backend.get_stats()
        assert sum(m.backup_pgs) == n_pages and sum(m.prefetch_pgs) >= n_pages
    finally:
        ctrl.detach_storage_backend()


def test_corrupt_block_is_a_miss_through_the_controller(tmp_path):
    _, host, ctrl = _setup(tmp_path, "page_first", mla=False)
    try:
        hp.fill(host, seed=3)
        src = host.alloc(5 * hp.PAGE)
        tokens = list(range(50, 50 + 5 * hp.PAGE))
        assert ch.backup(ctrl, src, tokens) == len(tokens)
        backend = ctrl.storage_backend
        third = block_key(backend.namespace.digest(), ch.page_hashes(tokens)[2])
        assert corrupt_block(str(tmp_path / "store"), third)

        # The index still lists the block, so the hit query finds 5 pages; the load stops at
        # the corrupt third page (verified checksum), and the first two pages are exact.
        hits, loaded, dst = ch.prefetch(ctrl, host, tokens)
        assert (hits, loaded) == (5 * hp.PAGE, 2 * hp.PAGE)
        for i in range(2):
            assert hp.page_bytes(host, int(dst[i * hp.PAGE])) == \
                hp.page_bytes(host, int(src[i * hp.PAGE]))
        # The bad block was dropped: the next hit query stops before it.
        assert ch.prefetch(ctrl, host, tokens, rid="again")[:2] == (2 * hp.PAGE, 2 * hp.PAGE)
        assert backend.store.stats().checksum_failures == 1
    finally:
        ctrl.detach_storage_backend()


def test_legacy_interface_through_the_controller(tmp_path):
    """Without interface_v1 the controller copies flat pages; the blocks are the same bytes."""
    kv = hp.device_pool(False)
    host = hp.host_pool(kv, "layer_first", pages=32)
    extra = hp.extra(str(tmp_path / "store"))
    del extra["interface_v1"]
    ctrl = ch.make_controller(kv, host, extra)
    try:
        assert ctrl.page_set_func == ctrl._generic_page_set
        hp.fill(host, seed=9)
        src = host.alloc(4 * hp.PAGE)
        tokens = list(range(300, 300 + 4 * hp.PAGE))
        want = [hp.page_bytes(host, int(src[i * hp.PAGE])) for i in range(4)]
        assert ch.backup(ctrl, src, tokens) == len(tokens)
        hits, loaded, dst = ch.prefetch(ctrl, host, tokens)
        assert hits == loaded == len(tokens)
        assert [hp.page_bytes(host, int(dst[i * hp.PAGE])) for i in range(4)] == want
        # The same blocks through the zero-copy interface.
        backend = ctrl.storage_backend
        assert backend.batch_get_v1(ch.page_hashes(tokens), dst) == [True] * 4
    finally:
        ctrl.detach_storage_backend()


def test_a_store_over_several_drives_through_the_controller(tmp_path):
    """`offload.store.paths`: SGLang's controller backs pages up to, and prefetches them from,
    one store spread over three directories; every directory holds a share."""
    drives = [str(tmp_path / f"nvme{i}" / "offload") for i in range(3)]
    kv = hp.device_pool(False)
    host = hp.host_pool(kv, hp.LAYOUTS[0], pages=64)
    extra = hp.extra(drives[0])
    extra["offload"]["store"].pop("path")
    extra["offload"]["store"]["paths"] = drives
    ctrl = ch.make_controller(kv, host, extra)
    try:
        from offload.store.base import find
        from offload.store.disk.spread import SpreadStore

        assert find(ctrl.storage_backend.store, SpreadStore)
        hp.fill(host, seed=11)
        n_pages = 24
        src = host.alloc(n_pages * hp.PAGE)
        tokens = list(range(3000, 3000 + n_pages * hp.PAGE))
        want = [hp.page_bytes(host, int(src[i * hp.PAGE])) for i in range(n_pages)]
        assert ch.backup(ctrl, src, tokens) == len(tokens)
        hits, loaded, dst = ch.prefetch(ctrl, host, tokens)
        assert hits == loaded == len(tokens)
        assert [hp.page_bytes(host, int(dst[i * hp.PAGE])) for i in range(n_pages)] == want
    finally:
        ctrl.detach_storage_backend()
    assert all(any(f.name.endswith(".slab") for f in (tmp_path / f"nvme{i}" / "offload").rglob("*"))
               for i in range(3))
