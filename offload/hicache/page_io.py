"""Moving host-pool pages to and from a block store: the one routine under the v1 (KV) and v2 (pool) calls.

Primitives (data path, no bookkeeping):
- `page_starts(pages, pool, n_keys, host_indices)`: each page's first host index, or None (logged)
  if SGLang's indices cannot be served (wrong count, not on page boundaries).
- `write_pages(store, pages, bkeys, starts, split)` / `read_pages(...)`: per-page success. A
  zero-copy `PageMap` moves pages straight between host memory and the store; any other goes
  through SGLang's flat-page copies (`page_copy`, `scratch` + `store_copy`). `split` (a
  `KeyPlan` of head groups, zero copy only): each page is several objects, `bkeys` page-major.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from offload.hicache.keying import KeyPlan, group_ok
from offload.hicache.layout import PageMap
from offload.store.base import BlockStore, Buffer

logger = logging.getLogger(__name__)


def page_starts(pages: PageMap, pool: str, n_keys: int, host_indices: Any) -> list[int] | None:
    """Each page's first host index for `n_keys` pages of `pool`, or None (logged)."""
    step = pages.index_step
    if host_indices is None or host_indices.numel() != n_keys * step:
        logger.error("offload: pool %s: %s host indices for %d pages of %d tokens", pool,
                     None if host_indices is None else host_indices.numel(), n_keys, step)
        return None
    starts = [int(s) for s in host_indices[::step].tolist()]
    if pages.zero_copy and any(pages.page_no(s) is None for s in starts):
        logger.error("offload: pool %s: host indices do not start on page boundaries", pool)
        return None
    return starts


def _split(split: KeyPlan, pages: PageMap, starts: Sequence[int]) -> list[list[Buffer]]:
    return [b for s in starts for b in split.blocks(pages.buffers(s))]


def write_pages(store: BlockStore, pages: PageMap, bkeys: Sequence[bytes],
                starts: Sequence[int], split: KeyPlan | None = None) -> list[bool]:
    """Store the pages starting at `starts` under `bkeys`."""
    if split is not None and split.split > 1:
        return group_ok(store.put_many(bkeys, _split(split, pages, starts)), split.split)
    blocks: list[list[Buffer]] = (
        [list(pages.buffers(s)) for s in starts] if pages.zero_copy
        else [[pages.page_copy(s)] for s in starts])
    return list(store.put_many(bkeys, blocks))


def read_pages(store: BlockStore, pages: PageMap, bkeys: Sequence[bytes],
               starts: Sequence[int], split: KeyPlan | None = None) -> list[bool]:
    """Load the blocks `bkeys` into the pages starting at `starts`; a page is written only on a hit
    (with a split, a page of which some objects missed is a miss, its other groups written)."""
    if split is not None and split.split > 1:
        return group_ok(store.get_many(bkeys, _split(split, pages, starts)), split.split)
    if pages.zero_copy:
        return list(store.get_many(bkeys, [pages.buffers(s) for s in starts]))
    scratch = [pages.scratch() for _ in starts]
    ok = list(store.get_many(bkeys, [[mv] for _, mv in scratch]))
    for s, (page, _), good in zip(starts, scratch, ok):
        if good:
            pages.store_copy(s, page)
    return ok
