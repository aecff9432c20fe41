"""OffloadStorage's v2 interface against SGLang's own `file` backend (HiCacheFile), differentially.

The same random sequences of writes (KV and sidecar pages, through the v2 calls SGLang makes),
restarts and deletions go to both; every query must give the same `kv_hit_pages` and
`restorable_prefix_pages`, and every page ours serves must be the bytes last written under it.
Pools: DRAFT (ALL_PAGES, indices from KV) and MAMBA (TRAILING_PAGES, 1 page) on an MHA anchor.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import pytest

torch = pytest.importorskip("torch")
hs = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.hicache import hicache_pools as hp  # noqa: E402
from tests.hicache import pool_families as pf  # noqa: E402

pytestmark = pytest.mark.slow

PT, PN, PP = hs.PoolTransfer, hs.PoolName, hs.PoolHitPolicy
KEYS = [f"{i:064x}" for i in range(1, 9)]
POOLS = (PN.KV, PN.DRAFT, PN.MAMBA)

op = st.one_of(
    st.tuples(st.just("write"), st.sampled_from(POOLS), st.integers(0, 7), st.integers(1, 8),
              st.integers(0, 255)),
    st.tuples(st.just("delete"), st.sampled_from(POOLS), st.integers(0, 7)),
    st.tuples(st.just("restart")),
    st.tuples(st.just("query"), st.integers(1, 8), st.sets(st.sampled_from(POOLS[1:]))),
)


class Pair:
    """Both backends over the same host pools; ours on a disk store, theirs in a directory."""

    def __init__(self, root: str):
        self.root = root
        self.anchor = hp.host_pool(hp.device_pool(), "page_first", 16)
        self.pools = {PN.KV: self.anchor, PN.DRAFT: pf._mha(1, "page_first", 16),
                      PN.MAMBA: pf._mamba(16)}
        self.open()

    def open(self) -> None:
        cfg = hp.storage_config(hp.extra(os.path.join(self.root, "ours")))
        self.ours = hp.make_backend(cfg, self.anchor)
        self.file = hs.HiCacheFile(hp.storage_config({}), os.path.join(self.root, "file"))
        self.file.register_mem_pool_host(self.anchor)
        for b in (self.ours, self.file):
            for name, pool in self.pools.items():
                b.register_mem_host_pool_v2(pool, name)
            b.on_host_pools_registered()

    def close(self) -> None:
        self.ours.close()

    def transfer(self, name: Any, first: int, keys: list[str]) -> Any:
        ps = self.pools[name].page_size
        return PT(name=name, keys=keys, host_indices=torch.arange(first * ps,
                                                                 (first + len(keys)) * ps))

    def delete(self, name: Any, key: str) -> None:
        comp = self.file._get_component_key(key, name)
        path = os.path.join(self.file.file_path, f"{comp}.bin")
        if os.path.exists(path):
            os.remove(path)
        pool = self.ours.pools.get(str(name.value))
        bkey = pool.keys([key])[0] if pool is not None else self.ours.block_keys([key])[0]
        self.ours.store.delete_many([bkey])


def _query(pair: Pair, n: int, names: set) -> list[Any]:
    keys = KEYS[:n]
    order = [x for x in POOLS[1:] if x in names]
    return [PT(name=x, keys=keys[-1:] if x == PN.MAMBA else keys,
               hit_policy=PP.TRAILING_PAGES if x == PN.MAMBA else PP.ALL_PAGES,
               indices_from_pool=None if x == PN.MAMBA else PN.KV) for x in order]


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(op, min_size=3, max_size=14))
def test_same_answers_as_sglangs_file_backend(ops):
    root = tempfile.mkdtemp(prefix="offload-diff-")
    pair = Pair(root)
    written: dict[tuple[str, str], bytes] = {}   # (pool, key) -> the bytes last written
    try:
        for o in ops:
            if o[0] == "write":
                _, name, start, count, seed = o
                keys = KEYS[start:start + count]
                pool = pair.pools[name]
                pf.fill_any(pool, seed)
                t = pair.transfer(name, 0, keys)
                ours = pair.ours.batch_set_v2([t])[name]
                theirs = pair.file.batch_set_v2([pair.transfer(name, 0, keys)])[name]
                assert ours == [True] * len(keys) and all(theirs)
                for i, k in enumerate(keys):
                    # the file backend keeps the first bytes of a key (it skips an existing file)
                    written.setdefault((name.value, k), pf.page_of(pool, i * pool.page_size))
            elif o[0] == "delete":
                _, name, i = o
                pair.delete(name, KEYS[i])
                written.pop((name.value, KEYS[i]), None)
            elif o[0] == "restart":
                pair.close()
                pair.open()
            else:
                _, n, names = o
                q = _query(pair, n, names)
                a = pair.ours.batch_exists_v2(KEYS[:n], q)
                b = pair.file.batch_exists_v2(KEYS[:n], _query(pair, n, names))
                assert (a.kv_hit_pages, list(a.restorable_prefix_pages)) == (
                    b.kv_hit_pages, list(b.restorable_prefix_pages)), (ops, o)
                for name in (PN.KV, *[t.name for t in q]):
                    pool = pair.pools[name]
                    keys = KEYS[:a.kv_hit_pages]
                    if name == PN.MAMBA:
                        keys = keys[-1:]
                    if not keys:
                        continue
                    got = pair.ours.batch_get_v2([pair.transfer(name, 8, keys)])[name]
                    assert all(got), (name, o)
                    for j, k in enumerate(keys):
                        assert pf.page_of(pool, (8 + j) * pool.page_size) == written[
                            (name.value, k)]
    finally:
        pair.close()
        shutil.rmtree(root, ignore_errors=True)
