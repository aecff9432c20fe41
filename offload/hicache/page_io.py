"""Moving one pool's pages to and from a block store: the one routine under the v1, v2 and KV calls.

Primitives (data path, no bookkeeping):
- `move(store, pool, keys, host_indices, write) -> Moved`: store (`write`) or load the pages of
  `pool` (a `pools.Pool`: KV or a sidecar) at SGLang's `host_indices` under SGLang's page hashes
  `keys`; per-page success. The pool decides the rest: its key plan (objects per page), and
  whether this rank writes it (a rank that does not, or a replica without bytes, reports what
  is stored and moves nothing). `Moved.seconds` is the I/O's duration, None when no bytes moved.
- `present(store, pool, keys)`: per page, all its objects are stored.
- `page_starts(pages, pool, n_keys, host_indices)`: each page's first host index, or None (logged)
  if SGLang's indices cannot be served (wrong count, not on page boundaries).
- `write_pages(store, pages, bkeys, starts, split)` / `read_pages(...)`: per-page success. A
  zero-copy `PageMap` moves pages straight between host memory and the store; any other goes
  through SGLang's flat-page copies (`page_copy`, `scratch` + `store_copy`). `split` (a
  `KeyPlan` of head groups, zero copy only): each page is several objects, `bkeys` page-major.

A store's failures come back as False flags (the stores never raise on the data path); SGLang's
calls are guarded once more by `never_raises` on `OffloadStorage`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple, Sequence

from offload.hicache.keying import KeyPlan, group_ok
from offload.hicache.layout import PageMap
from offload.hicache.pools import Pool
from offload.store.base import BlockStore, Buffer

logger = logging.getLogger(__name__)


class Moved(NamedTuple):
    """What `move` did: one flag per page, and the seconds its I/O took (None: no bytes moved,
    because this rank reported what is stored or SGLang's indices were refused)."""

    ok: list[bool]
    seconds: float | None = None


def present(store: BlockStore, pool: Pool, keys: Sequence[str]) -> list[bool]:
    """Per page of SGLang's `keys`: all of the pool's objects for it are stored."""
    return group_ok(store.exists_many(pool.keys(keys)), pool.split)


def move(store: BlockStore, pool: Pool, keys: Sequence[str], host_indices: Any,
         write: bool) -> Moved:
    """Store (`write`) or load `pool`'s pages at `host_indices` under `keys` (the module docstring)."""
    if not keys:
        return Moved([])
    if pool.pages is None:             # allocator-only MLA replica: the source rank's blocks
        return Moved(present(store, pool, keys))
    starts = page_starts(pool.pages, pool.name, len(keys), host_indices)
    if starts is None:
        return Moved([False] * len(keys))
    if write and not pool.writes:      # MLA: the storage writer (rank 0) writes shared pools
        return Moved(present(store, pool, keys))
    bkeys = pool.keys(keys)
    t0 = time.perf_counter()
    ok = (write_pages if write else read_pages)(store, pool.pages, bkeys, starts, pool.plan)
    return Moved(ok, time.perf_counter() - t0)


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
