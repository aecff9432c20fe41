"""SGLang's legacy (copying) storage interface of `OffloadStorage`: flat page tensors.

`exists/get/set/batch_get/batch_set` move SGLang's flat pages (`get_data_page(i, flat=True)`),
the same bytes as the zero-copy path, so a block written by either is read by both. Under a
head-split key plan (`offload.hicache.keying`) a flat page is cut into its K and V halves and
each half into head groups, as the zero-copy path cuts the pool's page. Data path: nothing raises.
"""

from __future__ import annotations

import time
from typing import Any, Callable, List, Sequence

from offload.hicache.keying import KeyPlan, group_ok
from offload.store.base import BlockStore, Buffer, never_raises


class LegacyMixin:
    """The legacy methods of `OffloadStorage`; it provides the attributes declared here."""

    store: BlockStore
    is_writer: bool
    mem_pool_host: Any
    plan: KeyPlan | None
    _keys: Callable[[Sequence[str]], list[bytes]]
    _split: Callable[[], int]
    _present: Callable[..., list[bool]]
    _record: Callable[..., None]
    batch_exists: Callable[..., int]

    def _objects(self, flat_pages: list[list[Buffer]]) -> list[list[Buffer]]:
        """Flat pages as the objects of the key plan (head groups of the K and V halves)."""
        if self._split() == 1 or self.plan is None:
            return flat_pages
        out: list[list[Buffer]] = []
        for (page,) in flat_pages:
            mv = memoryview(page).cast("B")
            half = mv.nbytes // 2
            out.extend(self.plan.blocks([mv[:half], mv[half:]]))
        return out

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any | None = None,
            target_sizes: Any | None = None) -> Any:
        out = self.batch_get([key], [target_location] if target_location is not None else None)
        return out[0]

    @never_raises("batch_get", lambda _self, keys, *_a, **_k: [None] * len(keys))
    def batch_get(self, keys: List[str], target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> List[Any]:
        """Read flat pages into `target_locations` (contiguous tensors); None for a miss."""
        import torch

        if target_locations is None:
            if self.mem_pool_host is None:
                return [None] * len(keys)
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        dests: list[list[Buffer]] = []
        for t in target_locations:
            if not t.is_contiguous():
                return [None] * len(keys)
            dests.append([memoryview(t.reshape(-1).view(torch.uint8).numpy())])
        t0 = time.perf_counter()
        ok = group_ok(self.store.get_many(self._keys(keys), self._objects(dests)), self._split())
        n = sum(ok)
        nbytes = sum(memoryview(d[0]).nbytes for d, g in zip(dests, ok) if g)
        self._record("prefetch", n, nbytes, t0, len(keys))
        return [t if g else None for t, g in zip(target_locations, ok)]

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        return self.batch_set([key], [value])

    @never_raises("batch_set", lambda *_a, **_k: False)
    def batch_set(self, keys: List[str], values: Any | None = None,
                  target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> bool:
        """Store flat page tensors; True only if every page is stored."""
        import torch

        if values is None or len(values) != len(keys):
            return False
        bkeys = self._keys(keys)
        if not self.is_writer:
            return all(self._present(bkeys, self._split()))
        blocks: list[list[Buffer]] = [
            [memoryview(v.contiguous().reshape(-1).view(torch.uint8).numpy())] for v in values]
        t0 = time.perf_counter()
        ok = group_ok(self.store.put_many(bkeys, self._objects(blocks)), self._split())
        n = sum(ok)
        self._record("backup", n, n * (memoryview(blocks[0][0]).nbytes if blocks else 0), t0, len(ok))
        return all(ok)
