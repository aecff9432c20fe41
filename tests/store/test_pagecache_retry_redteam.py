"""Red team of the page-cache share's drop retry (`slab/pagecache.py` `PageCache`: a drop that left
pages behind stays counted in `_stuck` and is tried again at the next keep and after each slab
sync, `retry`).

The `evict` a `PageCache` is built with is its seam: here it stands for `SlabFiles._drop` with
the outcome the kernel gives when a concurrent fdatasync of the slab holds the pages (False), at
the moment the test picks (an Event), which a real fdatasync cannot be made to hit on demand.
- a slot evicted, its drop failing on one thread while the slot is kept again and evicted again
  on another, whose drop fails too: both failures counted it, `held()` one slot too many for
  ever, the budget shrinking by a slot each time (broke; fixed: a slot already waiting for its
  retry is not counted twice);
- a drop failing while the slab's sync ends (its `retry` runs before the failure is recorded):
  nothing tries it again, `held()` stays over the budget and the pages stay cached once quiet
  (broke; fixed: a drop that failed while a retry ran is tried again at once);
- a stuck slot rewritten (kept again): counted once, as the newest (held);
- 8 threads keeping 64 slots with drops failing at random and a syncer retrying: `held()` never
  negative, and once quiet a slot of the whole budget kept last stays and is all that is counted
  (held after the fixes; before, the double count made it fail on some runs);
- nothing of this exists with `store.page_cache` 0: `SlabFiles` has no `PageCache` (held).
"""

from __future__ import annotations

import random
import threading

from offload.store.disk.slab.files import SlabFiles
from offload.store.disk.slab.pagecache import PageCache

S = 4096
WAIT_S = 120.0     # a deadline for a loaded box, never a timing assertion


class Drops:
    """The evict seam: drops of the slots in `fail` leave pages (False); the first drop of
    `block` waits for `release` (after setting `entered`) and then gives `blocked_result`."""

    def __init__(self) -> None:
        self.fail: set[int] = set()
        self.block: int | None = None
        self.blocked_result = False
        self.entered = threading.Event()
        self.release = threading.Event()
        self.dropped: list[int] = []

    def __call__(self, seg: int, slot_bytes: int, off: int, n: int) -> bool:
        slot = off // slot_bytes
        if slot == self.block:
            self.block = None
            self.entered.set()
            assert self.release.wait(WAIT_S), "the test never released the drop"
            ok = self.blocked_result
        else:
            ok = slot not in self.fail
        if ok:
            self.dropped.append(slot)
        return ok


def _in_flight(pc: PageCache, drops: Drops, slot: int) -> threading.Thread:
    """Keep `slot` on another thread, whose eviction of the oldest slot blocks in its drop."""
    t = threading.Thread(target=pc.keep, args=(0, S, slot, S), daemon=True)
    t.start()
    assert drops.entered.wait(WAIT_S), "the drop never started"
    return t


def test_a_slot_whose_two_drops_fail_is_counted_once() -> None:
    drops = Drops()
    pc = PageCache(S, drops)
    pc.keep(0, S, 1, S)
    drops.block = 1                       # slot 1's first drop: in flight, then fails
    a = _in_flight(pc, drops, 2)
    pc.keep(0, S, 1, S)                   # slot 1 read again: the newest (slot 2 dropped)
    drops.fail = {1}
    pc.keep(0, S, 3, S)                   # slot 1 evicted again, this drop fails too
    assert pc.held() == 2 * S             # slot 3, and slot 1 waiting for its retry
    drops.release.set()
    a.join(WAIT_S)
    assert not a.is_alive()
    assert pc.held() == 2 * S, "slot 1 counted twice"
    drops.fail = set()
    pc.retry()
    assert pc.held() == S                 # slot 3 alone


def test_a_drop_failing_while_the_sync_ends_is_tried_again() -> None:
    drops = Drops()
    pc = PageCache(S, drops)
    pc.keep(0, S, 1, S)
    drops.block = 1                       # DONTNEED skips slot 1's pages: an fdatasync holds them
    a = _in_flight(pc, drops, 2)
    pc.retry()                            # that fdatasync returns: the sync's retry, nothing yet
    drops.release.set()                   # ... and only now is slot 1's failure recorded
    a.join(WAIT_S)
    assert not a.is_alive()
    # quiet: no more keeps, no more syncs; slot 1's pages would drop now
    assert pc.held() <= pc.budget, "a failed drop nobody tries again"
    assert 1 in drops.dropped


def test_a_stuck_slot_rewritten_is_counted_once_as_the_newest() -> None:
    drops = Drops()
    pc = PageCache(2 * S, drops)
    pc.keep(0, S, 1, S)
    pc.keep(0, S, 2, S)
    drops.fail = {1}
    pc.keep(0, S, 3, S)                   # slot 1's drop fails: stuck
    assert pc.held() == 3 * S
    drops.fail = set()
    pc.keep(0, S, 1, S)                   # slot 1 rewritten: the newest, counted once
    assert pc.held() == 2 * S and drops.dropped == [2]
    pc.keep(0, S, 4, S)
    pc.keep(0, S, 5, S)
    assert pc.held() == 2 * S and drops.dropped == [2, 3, 1]


def test_keeps_drops_and_retries_on_many_threads_keep_the_books() -> None:
    budget = 8 * S
    lock = threading.Lock()
    rnd = random.Random(11)
    failing = [True]

    def evict(seg: int, slot_bytes: int, off: int, n: int) -> bool:
        with lock:
            ok = not failing[0] or rnd.random() > 0.4
        threading.Event().wait(0.0001)     # let another thread in while the drop runs
        return ok

    pc = PageCache(budget, evict)
    lows: list[int] = []
    stop = threading.Event()

    def keeper(t: int) -> None:
        r = random.Random(t)
        for _ in range(1500):
            pc.keep(0, S, r.randrange(64), r.randint(1, 3) * S)

    def syncer() -> None:
        while not stop.is_set():
            pc.retry()
            lows.append(pc.held())

    threads = [threading.Thread(target=keeper, args=(t,)) for t in range(8)]
    sync = threading.Thread(target=syncer)
    sync.start()
    for th in threads:
        th.start()
    for th in threads:
        th.join(WAIT_S)
    stop.set()
    sync.join(WAIT_S)
    assert not any(th.is_alive() for th in threads) and not sync.is_alive()
    assert min(lows) >= 0
    failing[0] = False
    pc.retry()
    pc.keep(0, budget, 1000, budget)       # quiet: a slot of the whole budget, kept last
    assert pc.held() == budget, "bytes counted for slots no longer kept"


def test_no_page_cache_no_books(tmp_path) -> None:
    assert SlabFiles(str(tmp_path), "on", page_cache=0).cache is None
    assert SlabFiles(str(tmp_path), "off", page_cache=1 << 20).cache is None
    assert SlabFiles(str(tmp_path), "on", page_cache=1 << 20).cache is not None
