"""Concurrent users whose storage hits together exceed L2's free room: every hit loads in full (issue 35).

A real SGLang server, started through `sglang-offload launch` on the CPU with the disk L3, a small
L1 (4,096 tokens) and a small L2 host pool (1.25x L1: 80 pages of 64 tokens). Three users' prompts
(~19 pages each) are served cold one by one and written back to the store. SGLang's
`/flush_cache` empties L1 and L2; three other prompts then fill L1 with unlocked pages whose host
copies (write_through) take ~57 of the 80 host pages, written back too, so L2's free room is ~23
pages. The three users then ask again at once (threads): their storage hits, 57 pages together,
do not fit that room. Upstream SGLang's cache mode trims a hit to the room left after
`evict_host`, which frees only host pages no longer on the device, and recomputes the tail;
patch 0018 first takes room from host copies of unlocked device pages (safe in the L3) and
otherwise waits, so every user's hit is loaded from storage in full (`cached_tokens_details`
`storage` = the prompt's full pages) and its greedy output equals the cold one.

Run against the series less 0018 (`PYTHONPATH=$(distro/shadow_tree.py --without 0018 --out D)`
for pytest, whose servers inherit it) the storage assertion fails: some user's hit is partly
recomputed. No wall clock is asserted; the prefetch deadline's cap is generous so that a loaded
box does not turn a slow load into a recompute.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from threading import Barrier
from typing import Callable

import pytest

from offload.launch.server import LaunchedServer, Reply, wait_store
from tests.e2e.conftest import PAGE, assert_agrees, flush_l1_l2, full_pages, needs_serving, prompt

pytestmark = [needs_serving, pytest.mark.timeout(1200)]
TOKENS = 1200            # ~19 pages per prompt
USERS = 3                # their hits: ~57 pages, against ~23 pages of free L2 room
L1_TOKENS = 4096         # SGLang's max-total-tokens: 64 pages
L2_RATIO = 1.25          # hicache-ratio: an 80-page host pool
CAP_S = 120              # launch's cap on the prefetch wait (a loaded box loads slowly)


def _pages(replies: list[Reply]) -> int:
    return sum(full_pages(r.prompt_tokens) // PAGE for r in replies)


def test_concurrent_storage_hits_past_l2_room_load_in_full_with_the_same_output(
        servers: Callable[..., LaunchedServer], tmp_path: Path, demo_model: Path) -> None:
    store = tmp_path / "store"
    s = servers(store, name="l2-pressure",
                sglang={"max-total-tokens": L1_TOKENS, "hicache-ratio": L2_RATIO,
                        "context-length": L1_TOKENS},
                worth_it={"max_prefetch_wait_s": CAP_S})
    users = [prompt(TOKENS, 3500 + i) for i in range(USERS)]
    cold = [s.generate(p) for p in users]                 # one by one: each computed in full
    assert all(r.cached_tokens == 0 for r in cold), [r.cached_tokens for r in cold]
    written = _pages(cold)
    assert wait_store(store, written) >= written, s.tail()

    flush_l1_l2(s)                                        # L1 and L2 empty, the L3 kept
    fillers = [s.generate(prompt(TOKENS, 3600 + i)) for i in range(USERS)]
    assert all(r.cached_tokens == 0 for r in fillers), [r.cached_tokens for r in fillers]
    written += _pages(fillers)                            # their write-backs done: host pages unlocked
    assert wait_store(store, written) >= written, s.tail()
    room = int(L1_TOKENS * L2_RATIO) // PAGE - _pages(fillers)
    assert _pages(cold) > room, (_pages(cold), room)      # the hits together exceed L2's free room

    start = Barrier(USERS)

    def ask(text: str) -> Reply:
        start.wait()
        return s.generate(text)

    with ThreadPoolExecutor(USERS) as pool:               # every user at once
        again = list(pool.map(ask, users))

    loaded = [(r.details.get("storage", 0), full_pages(c.prompt_tokens))
              for r, c in zip(again, cold)]
    print(f"L2 free room ~{room} pages; storage tokens loaded / full pages per user: {loaded}")
    for r, c in zip(again, cold):
        assert_agrees(c, r, "a concurrent storage hit", demo_model)
        assert r.details.get("storage", 0) == full_pages(c.prompt_tokens), (loaded, r.details)
        assert r.cached_tokens == full_pages(c.prompt_tokens), (loaded, r)
