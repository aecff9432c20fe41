"""Red team of `offload.transfer.write_budget` (`WriteBudget` on the cpu path's write lane).

Attacks, each a test here:
- a promotion never touches the budget: on host pages it runs on the read lane (held); a
  promotion of GPU pages (the stager's CPU stand-in) went to the write lane, was skipped by a
  budget in debt and spent its credit (broke; fixed: the stager's promotions go to the read lane,
  through the store's promote);
- gets never wait on nor are refused by a budget in debt, host or GPU pages (held);
- a skipped put never reports a page stored that is not: many threads putting through a small
  budget, every page True is in the store, every page False is not and is counted (held);
- the average rate holds: 200,000 batches of random sizes arriving at 3x the budget on a clock
  far from 0 (1e9 s, coarse floats): what is taken stays within rate x time + one second + the
  largest batch, and uses the budget (held);
- an injected clock going backwards (an hour) left the bucket an hour's bytes in debt, skipping
  every write-back for an hour (broke; fixed: a step back gives and takes no credit);
- config errors name `offload.transfer.write_budget` (held).
Clocks are injected (`WriteBudget(rate, clock)`); no wall-clock assertion.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest

from offload.config import ConfigError, load_offload
from offload.store.memory.store import MemoryStore
from offload.transfer.cpu_staging import CpuStagingPath, WriteBudget
from tests.transfer.standin import CpuOps, OnGpu

PAGE = 4096


def key(tag: str) -> bytes:
    return tag.encode().ljust(32, b"\0")


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _in_debt(path: CpuStagingPath) -> None:
    """Run the path's budget (8 pages a second) into debt: the next write-back is skipped."""
    page = [b"p" * PAGE]
    assert path.put_many([key(f"debt{i}") for i in range(12)], [page] * 12) == [True] * 12
    assert path.put_many([key("skipped")], [page]) == [False]


def test_a_promotion_of_host_pages_ignores_a_budget_in_debt() -> None:
    path = CpuStagingPath(MemoryStore(), write_budget=WriteBudget(8 * PAGE, Clock()))
    try:
        _in_debt(path)
        assert path.promote_many([key("up")], [[b"u" * PAGE]]) == [True]
        out = bytearray(PAGE)
        assert path.get_many([key("up")], [[out]]) == [True] and bytes(out) == b"u" * PAGE
        assert path.stats().extra["write_budget_skipped"] == 1
    finally:
        path.close()


def test_a_promotion_of_gpu_pages_ignores_a_budget_in_debt() -> None:
    """The GPU stager's promotions are puts on a get's path too: never skipped by the budget,
    never spending its credit."""
    torch = pytest.importorskip("torch")
    clock = Clock()
    path = CpuStagingPath(MemoryStore(), device_ops=CpuOps(),
                          write_budget=WriteBudget(8 * PAGE, clock))
    try:
        _in_debt(path)
        src = torch.arange(PAGE, dtype=torch.uint8)
        assert path.promote_many([key("gpu-up")], [[OnGpu(src)]]) == [True]
        assert path.stats().extra["write_budget_skipped"] == 1
        dst = OnGpu(torch.zeros_like(src))
        assert path.get_many([key("gpu-up")], [[dst]]) == [True]
        assert torch.equal(dst.tensor, src)
        # and it spent no credit: 0.5 s gives back the 4 pages of debt, then a write-back goes
        clock.now += 0.5 + 1e-6
        assert path.put_many([key("after")], [[b"a" * PAGE]]) == [True]
    finally:
        path.close()


def test_gets_of_host_and_gpu_pages_ignore_a_budget_in_debt() -> None:
    torch = pytest.importorskip("torch")
    path = CpuStagingPath(MemoryStore(), device_ops=CpuOps(),
                          write_budget=WriteBudget(8 * PAGE, Clock()))
    try:
        _in_debt(path)
        out = bytearray(PAGE)
        assert path.get_many([key("debt0")], [[out]]) == [True] and bytes(out) == b"p" * PAGE
        dst = OnGpu(torch.zeros(PAGE, dtype=torch.uint8))
        assert path.get_many([key("debt1")], [[dst]]) == [True]
        assert bytes(dst.tensor.numpy()) == b"p" * PAGE
        assert path.stats().extra["write_budget_skipped"] == 1
    finally:
        path.close()


def test_a_skipped_page_is_never_reported_stored_under_many_threads() -> None:
    """8 threads x 200 puts of 1-4 pages through a budget of 16 pages a second on a clock that
    moves a little with every call: each page reported stored is in the store with its bytes,
    each page reported not stored is absent, and the skipped count is the pages not stored."""
    lock = threading.Lock()
    ticks = [0.0]

    def clock() -> float:
        with lock:
            ticks[0] += 0.001
            return ticks[0]

    store = MemoryStore()
    path = CpuStagingPath(store, write_budget=WriteBudget(16 * PAGE, clock))
    results: dict[bytes, bool] = {}

    def writer(t: int) -> None:
        rnd = random.Random(t)
        for i in range(200):
            ks = [key(f"t{t}-{i}-{j}") for j in range(rnd.randint(1, 4))]
            flags = path.put_many(ks, [[k * (PAGE // 32)] for k in ks])
            with lock:
                results.update(zip(ks, flags))

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not any(th.is_alive() for th in threads)
        ks = list(results)
        assert path.exists_many(ks) == [results[k] for k in ks]
        stored = [k for k in ks if results[k]]
        outs = [bytearray(PAGE) for _ in stored]
        assert path.get_many(stored, [[o] for o in outs]) == [True] * len(stored)
        assert all(bytes(o) == k * (PAGE // 32) for k, o in zip(stored, outs))
        skipped = sum(not f for f in results.values())
        assert 0 < skipped < len(results)
        assert path.stats().extra["write_budget_skipped"] == skipped
    finally:
        path.close()


def test_the_average_rate_holds_on_a_coarse_clock() -> None:
    """200,000 batches of 1-64 pages arriving at 3x the budget, on a clock near 1e9 s (where a
    float step is about 1e-7 s): what is taken is at most rate x time + one second of credit +
    the largest batch, and at least rate x time - the largest batch (the budget is used)."""
    rate = 1 << 30
    start = 1e9
    clock = Clock(start)
    budget = WriteBudget(rate, clock)
    rnd = random.Random(7)
    taken = largest = 0
    for _ in range(200_000):
        n = rnd.randint(1, 64) * (2 << 20)
        largest = max(largest, n)
        clock.now += n / (3 * rate)
        if budget.take(n):
            taken += n
    elapsed = clock.now - start
    assert taken <= rate * elapsed + rate + largest
    assert taken >= rate * elapsed - largest


def test_a_clock_going_backwards_takes_no_credit() -> None:
    """An injected clock stepping back an hour (a wall clock set back) neither gives credit nor
    takes an hour of it away: the next write-back goes as it would have."""
    rate = 8 * PAGE
    clock = Clock(10_000.0)
    budget = WriteBudget(rate, clock)
    assert budget.take(4 * PAGE)          # 4 pages of credit left
    clock.now -= 3600
    assert budget.take(PAGE)              # 3 left
    clock.now += 3600                     # back where it was: a second's credit at most
    assert budget.take(8 * PAGE)          # 8 pages taken: none left
    assert not budget.take(PAGE)


@pytest.mark.parametrize("value, says", [
    ("0", "less than one page a second"), ("512KiB", "less than one page a second"),
    ("-1MiB", "is not a size"), ("lots", "is not a size"), (True, "not a boolean")])
def test_a_bad_write_budget_names_the_key(tmp_path: Any, value: Any, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_offload({"store": {"path": str(tmp_path / "c"), "capacity": "64MiB"},
                      "transfer": {"path": "cpu", "write_budget": value}})
    assert "offload.transfer.write_budget" in str(e.value) and says in str(e.value)
