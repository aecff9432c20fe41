"""OffloadStorage through SGLang's backend factory, on real host pools and a real DiskStore.

Zero copy per layout, legacy/v1 interop, leading-hit semantics, failures as misses, settings,
namespaces (TP ranks, MLA sharing, salt, layout), metrics and clear.
"""

from __future__ import annotations

import pytest
import torch

from offload.errors import ConfigError, PathUnavailableError
from offload.hicache import backend as hicache
from offload.store.faults import FaultyMemoryStore
from offload.store.memory.store import MemoryStore
from tests.hicache import hicache_pools as hp

P = hp.PAGE


def _backend(tmp_path, layout="page_first", mla=False, tp_rank=0, tp_size=1, metrics=False,
             pages=16, extra=None, **offload):
    host = hp.host_pool(hp.device_pool(mla), layout, pages=pages)
    sc = hp.storage_config(extra or hp.extra(str(tmp_path / "store"), **offload), mla=mla,
                           tp_rank=tp_rank, tp_size=tp_size, metrics=metrics, layout=layout)
    return hp.make_backend(sc, host), host


def _idx(first_page: int, n: int) -> torch.Tensor:
    return torch.arange(first_page * P, (first_page + n) * P)


KEYS = [f"{i:064x}" for i in range(1, 9)]


LAYOUT_CASES = [(layout, mla) for mla in (False, True) for layout in hp.LAYOUTS]
LAYOUT_CASES.append(("page_head", False))  # an MHA-only layout


@pytest.mark.parametrize("layout,mla", LAYOUT_CASES,
                         ids=[f"{lay}-{'mla' if m else 'mha'}" for lay, m in LAYOUT_CASES])
def test_pages_are_views_of_the_pool_in_sglang_byte_order(tmp_path, layout, mla):
    b, host = _backend(tmp_path, layout, mla)
    assert isinstance(b, hicache.OffloadStorage)
    assert b.pages.zero_copy
    hp.fill(host, 1)
    lo = host.kv_buffer.data_ptr()
    hi = lo + host.kv_buffer.numel() * host.kv_buffer.element_size()
    import numpy as np

    for page in (0, 3, 15):
        bufs = b.pages.buffers(page * P)
        for mv in bufs:
            addr = np.frombuffer(mv, dtype=np.uint8).ctypes.data
            assert lo <= addr and addr + mv.nbytes <= hi  # inside the pool: no copy
        assert b"".join(bytes(mv) for mv in bufs) == hp.page_bytes(host, page * P)
    expected = {"page_first": 1 if mla else 2, "page_first_direct": 1 if mla else 2,
                "page_head": 2, "layer_first": hp.LAYERS * (1 if mla else 2)}[layout]
    assert b.pages.buffers_per_page == expected
    b.close()


def test_v1_and_legacy_interfaces_share_blocks(tmp_path):
    b, host = _backend(tmp_path)
    hp.fill(host, 2)
    want = [hp.page_bytes(host, i * P) for i in range(4)]
    assert b.batch_set_v1(KEYS[:4], _idx(0, 4)) == [True] * 4
    # Legacy read of a v1 block into SGLang's dummy flat page.
    pages = b.batch_get(KEYS[:4], [host.get_dummy_flat_data_page() for _ in range(4)])
    assert [p.view(torch.uint8).numpy().tobytes() for p in pages] == want
    assert b.get(KEYS[0], host.get_dummy_flat_data_page()) is not None
    assert b.get("f" * 64, host.get_dummy_flat_data_page()) is None
    # Legacy write of a flat page, v1 read into the pool.
    assert b.batch_set(KEYS[4:6], [host.get_data_page(i * P) for i in (8, 9)])
    assert b.set(KEYS[6], host.get_data_page(10 * P))
    want2 = [hp.page_bytes(host, i * P) for i in (8, 9, 10)]
    hp.fill(host, 3)
    assert b.batch_get_v1(KEYS[4:7], _idx(12, 3)) == [True] * 3
    assert [hp.page_bytes(host, i * P) for i in (12, 13, 14)] == want2
    assert b.exists(KEYS[6]) and not b.exists(KEYS[7])
    b.close()


def test_batch_exists_counts_the_leading_run(tmp_path):
    b, _ = _backend(tmp_path)
    assert b.batch_set_v1([KEYS[0], KEYS[1], KEYS[3]], torch.cat([_idx(0, 2), _idx(3, 1)])) == \
        [True] * 3
    assert b.batch_exists(KEYS[:4]) == 2
    assert b.batch_exists([KEYS[2]] + KEYS[:2]) == 0
    assert b.batch_exists(KEYS[:2]) == 2
    assert b.batch_exists([]) == 0
    b.close()


def test_bad_calls_are_failures_not_exceptions(tmp_path):
    b, host = _backend(tmp_path)
    assert b.batch_set_v1(KEYS[:2], _idx(0, 1)) == [False, False]       # too few indices
    assert b.batch_set_v1(KEYS[:1], torch.arange(3, 3 + P)) == [False]   # not a page start
    assert b.batch_get_v1(KEYS[:1], _idx(0, 1)) == [False]               # nothing stored
    assert b.batch_set_v1([], _idx(0, 0)) == []
    b.close()
    sc = hp.storage_config(hp.extra(str(tmp_path / "s2")))
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    unregistered = StorageBackendFactory.create_backend("dynamic", sc, host)
    assert unregistered.batch_set_v1(KEYS[:1], _idx(0, 1)) == [False]
    assert unregistered.batch_get_v1(KEYS[:1], _idx(0, 1)) == [False]


class _BrokenStore(MemoryStore):
    def get_many(self, keys, dests):
        raise OSError("disk on fire")

    def exists_many(self, keys):
        raise OSError("disk on fire")


def test_read_failures_are_misses(tmp_path, monkeypatch):
    mem = FaultyMemoryStore()
    monkeypatch.setattr(hicache, "_open_store", lambda cfg: mem)
    b, host = _backend(tmp_path)
    hp.fill(host, 4)
    assert all(b.batch_set_v1(KEYS[:3], _idx(0, 3)))
    mem.fail_reads.add(b.block_keys([KEYS[1]])[0])
    assert b.batch_get_v1(KEYS[:3], _idx(5, 3)) == [True, False, True]
    mem.fail_writes.add(b.block_keys([KEYS[5]])[0])
    assert b.batch_set_v1(KEYS[4:6], _idx(0, 2)) == [True, False]

    broken = _BrokenStore()
    monkeypatch.setattr(hicache, "_open_store", lambda cfg: broken)
    b2, _ = _backend(tmp_path)
    assert b2.batch_exists(KEYS[:2]) == 0
    assert b2.batch_get_v1(KEYS[:2], _idx(0, 2)) == [False, False]
    assert b2.batch_get(KEYS[:1], [host.get_dummy_flat_data_page()]) == [None]


def test_settings_errors_name_the_key(tmp_path):
    base = hp.extra(str(tmp_path / "s"))
    with pytest.raises(ConfigError, match="extra-config.bogus: unknown key"):
        _backend(tmp_path, extra={**base, "bogus": 1})
    b, _ = _backend(tmp_path, extra={**base, "prefetch_threshold": 64, "allocator": "default"})
    b.close()                                              # SGLang's own keys are ignored
    with pytest.raises(ConfigError, match="offload.store.capacity"):
        _backend(tmp_path, store={"capacity": "lots"})
    with pytest.raises(ConfigError, match="offload.stor: unknown key"):
        _backend(tmp_path, extra={**base, "offload": {"stor": {}}})
    with pytest.raises(ConfigError, match="expected a mapping"):
        _backend(tmp_path, extra={**base, "offload": "x"})
    with pytest.raises(ConfigError, match="cannot read the config file"):
        _backend(tmp_path, extra={**base, "config_file": str(tmp_path / "missing.yaml")})
    with pytest.raises(PathUnavailableError, match="transfer.path"):
        _backend(tmp_path, transfer={"path": "gds"})


def test_config_file_with_inline_override(tmp_path):
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text(f"offload:\n  store:\n    path: {tmp_path / 'from-file'}\n"
                   "    capacity: 64MiB\n    min_free: 0\n    salt: tenant-a\n")
    cfg.chmod(0o600)                  # it holds the salt: a loose file is refused
    extra = {"backend_name": "offload", "module_path": "offload.hicache",
             "class_name": "OffloadStorage", "interface_v1": 1, "config_file": str(cfg),
             "offload": {"store": {"capacity": "128MiB"}}}
    b, _ = _backend(tmp_path, extra=extra)
    assert b.cfg.store.path == str(tmp_path / "from-file")
    assert b.cfg.store.capacity == 128 << 20 and b.cfg.store.salt == "tenant-a"
    assert b.namespace.salt == "tenant-a"
    b.close()


def test_namespaces_separate_ranks_layouts_and_tenants(tmp_path):
    r0, h0 = _backend(tmp_path, tp_rank=0, tp_size=2)
    hp.fill(h0, 5)
    assert all(r0.batch_set_v1(KEYS[:2], _idx(0, 2)))
    r1, _ = _backend(tmp_path, tp_rank=1, tp_size=2)
    assert r1.batch_exists(KEYS[:2]) == 0                    # another TP shard of the heads
    lf, _ = _backend(tmp_path, layout="layer_first", tp_rank=0, tp_size=2)
    assert lf.batch_exists(KEYS[:2]) == 0                    # other byte layout
    salted, _ = _backend(tmp_path, tp_rank=0, tp_size=2, store={"salt": "tenant-b"})
    assert salted.batch_exists(KEYS[:2]) == 0                # other tenant
    again, _ = _backend(tmp_path, tp_rank=0, tp_size=2)
    assert again.batch_exists(KEYS[:2]) == 2
    assert r0.namespace.dtype == "bfloat16" and r0.namespace.page_size == P
    for b in (r0, r1, lf, salted, again):
        b.close()


def test_mla_ranks_share_one_namespace_and_one_writer(tmp_path):
    w, hw = _backend(tmp_path, mla=True, tp_rank=0, tp_size=4)
    r, hr = _backend(tmp_path, mla=True, tp_rank=2, tp_size=4)
    assert w.namespace == r.namespace and w.is_writer and not r.is_writer
    hp.fill(hr, 6)
    assert r.batch_set_v1(KEYS[:2], _idx(0, 2)) == [False, False]   # a replica does not write
    assert not r.batch_set(KEYS[:1], [hr.get_data_page(0)])
    assert w.batch_exists(KEYS[:2]) == 0
    hp.fill(hw, 7)
    want = [hp.page_bytes(hw, i * P) for i in range(2)]
    assert all(w.batch_set_v1(KEYS[:2], _idx(0, 2)))
    hp.durable(w)
    assert r.batch_set_v1(KEYS[:2], _idx(0, 2)) == [True, True]     # stored by the writer
    assert r.batch_get_v1(KEYS[:2], _idx(4, 2)) == [True, True]
    assert [hp.page_bytes(hr, i * P) for i in (4, 5)] == want
    w.close()
    r.close()


def test_metrics_and_clear(tmp_path):
    b, host = _backend(tmp_path, metrics=True)
    quiet, _ = _backend(tmp_path, tp_rank=1, tp_size=2)
    assert quiet.get_stats() is None
    assert all(b.batch_set_v1(KEYS[:3], _idx(0, 3)))
    assert all(quiet.batch_set_v1(KEYS[:3], _idx(0, 3)))
    assert all(b.batch_get_v1(KEYS[:3], _idx(4, 3)))
    m = b.get_stats()
    assert m.backup_pgs == [3] and m.prefetch_pgs == [3]
    assert m.backup_bandwidth[0] > 0 and m.prefetch_bandwidth[0] > 0
    assert b.get_stats().backup_pgs == []                   # drained on read, like SGLang's own
    assert b.clear() is True
    assert b.batch_exists(KEYS[:3]) == 0
    assert quiet.batch_exists(KEYS[:3]) == 3                 # another namespace is kept
    b.close()
    quiet.close()


def test_fast_block_keys_equal_block_key():
    from offload.keys import block_key, key_maker

    ns = bytes(range(16))
    hashes = ["", "a", "f" * 64, "é"] + KEYS
    assert key_maker(ns)(hashes) == [block_key(ns, h) for h in hashes]
