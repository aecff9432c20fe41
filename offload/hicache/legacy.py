"""SGLang's legacy (copying) storage interface: `Legacy`, a part of `OffloadStorage`.

`exists/get/set/batch_get/batch_set` move SGLang's flat pages (`get_data_page(i, flat=True)`),
the same bytes as the zero-copy path, so a block written by either is read by both. Under a
head-split key plan (`offload.hicache.keying`) a flat page is cut into its K and V halves and
each half into head groups, as the zero-copy path cuts the pool's page. `exists` is
`KvPages.exists` of one key (the worth-it rule included). Data path: the face guards every call
with `never_raises`; nothing here catches.
"""

from __future__ import annotations

import time
from typing import Any, List, Sequence

from offload.hicache.keying import group_ok
from offload.hicache.kv import KvPages
from offload.hicache.recorder import Recorder
from offload.hicache.state import BackendState
from offload.store.base import Buffer


class Legacy:
    def __init__(self, st: BackendState, kv: KvPages, rec: Recorder):
        self.st, self.kv, self.rec = st, kv, rec

    def _objects(self, flat_pages: list[list[Buffer]]) -> list[list[Buffer]]:
        """Flat pages as the objects of the key plan (head groups of the K and V halves)."""
        kv = self.st.kv
        if kv is None or kv.split == 1:
            return flat_pages
        out: list[list[Buffer]] = []
        for (page,) in flat_pages:
            mv = memoryview(page).cast("B")
            half = mv.nbytes // 2
            out.extend(kv.plan.blocks([mv[:half], mv[half:]]))
        return out

    def exists(self, key: str) -> bool:
        return self.kv.exists([key]) == 1

    def batch_get(self, keys: Sequence[str], target_locations: Any | None) -> List[Any]:
        """Read flat pages into `target_locations` (contiguous tensors); None for a miss."""
        import torch

        st = self.st
        if target_locations is None:
            if st.host is None:
                return [None] * len(keys)
            target_locations = [st.host.get_dummy_flat_data_page() for _ in keys]
        dests: list[list[Buffer]] = []
        for t in target_locations:
            if not t.is_contiguous():
                return [None] * len(keys)
            dests.append([memoryview(t.reshape(-1).view(torch.uint8).numpy())])
        t0 = time.perf_counter()
        ok = group_ok(st.store.get_many(st.kv_keys(keys), self._objects(dests)), st.kv_split)
        n = sum(ok)
        nbytes = sum(memoryview(d[0]).nbytes for d, g in zip(dests, ok) if g)
        self.rec.record("prefetch", "kv", n, nbytes, time.perf_counter() - t0, len(keys))
        return [t if g else None for t, g in zip(target_locations, ok)]

    def batch_set(self, keys: Sequence[str], values: Any | None) -> bool:
        """Store flat page tensors; True only if every page is stored."""
        import torch

        st = self.st
        if values is None or len(values) != len(keys):
            return False
        bkeys = st.kv_keys(keys)
        if not st.is_writer:
            return all(group_ok(st.store.exists_many(bkeys), st.kv_split))
        blocks: list[list[Buffer]] = [
            [memoryview(v.contiguous().reshape(-1).view(torch.uint8).numpy())] for v in values]
        t0 = time.perf_counter()
        ok = group_ok(st.store.put_many(bkeys, self._objects(blocks)), st.kv_split)
        n = sum(ok)
        self.rec.record("backup", "kv", n, n * (memoryview(blocks[0][0]).nbytes if blocks else 0),
                        time.perf_counter() - t0, len(ok))
        return all(ok)
