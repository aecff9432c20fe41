"""The cpu path's two lanes: a read never waits for a write it does not need, and the write lane
holds a bounded amount (a put past the bound is refused at once, every page not stored).

A real `MemoryStore` whose put blocks on an Event stands for a write-back stuck in the store (a
slow drive, an index held by another process); the test then shows a get, a promotion and a GPU
page's get (the CPU stand-in of the stager) each complete while that put is still blocked. No
wall-clock assertion: every wait is an Event or a join with a generous deadline.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import pytest

from offload.store.memory.store import MemoryStore
from offload.transfer.cpu_staging import CpuStagingPath
from tests.transfer.standin import CpuOps, OnGpu

WAIT_S = 120.0       # a deadline for a loaded CI box, never a timing assertion


def key(tag: str) -> bytes:
    return tag.encode().ljust(32, b"\0")


class BlockingStore(MemoryStore):
    """A store whose puts wait for `release` (after setting `entered`) while `block` is set;
    records the CPU set of the thread of each call."""

    def __init__(self) -> None:
        super().__init__()
        self.block = threading.Event()
        self.entered = threading.Event()
        self.release = threading.Event()
        self.affinity: dict[str, set[int]] = {}

    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Any]]) -> list[bool]:
        self.affinity["put"] = os.sched_getaffinity(0)
        if self.block.is_set():
            self.entered.set()
            assert self.release.wait(WAIT_S), "the test never released the put"
        return super().put_many(keys, blocks)

    def get_many(self, keys: Sequence[bytes], dests: Sequence[Sequence[Any]]) -> list[bool]:
        self.affinity["get"] = os.sched_getaffinity(0)
        return super().get_many(keys, dests)


class Blocked:
    """A put through `path` that is stuck in the store until `finish()`."""

    def __init__(self, path: CpuStagingPath, store: BlockingStore, keys: list[bytes],
                 blocks: list[list[Any]]):
        self.store, self.flags = store, None
        store.block.set()
        self.thread = threading.Thread(target=self._put, args=(path, keys, blocks), daemon=True)
        self.thread.start()
        assert store.entered.wait(WAIT_S), "the put never reached the store"

    def _put(self, path: CpuStagingPath, keys: list[bytes], blocks: list[list[Any]]) -> None:
        self.flags = path.put_many(keys, blocks)

    def still_blocked(self) -> bool:
        return self.thread.is_alive() and not self.store.release.is_set()

    def finish(self) -> list[bool] | None:
        self.store.release.set()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()
        return self.flags


@pytest.fixture
def rig():
    store = BlockingStore()
    path = CpuStagingPath(store, device_ops=CpuOps())
    yield store, path
    store.release.set()
    path.close()


def test_a_get_returns_while_a_put_is_blocked(rig) -> None:
    store, path = rig
    assert path.put_many([key("a")], [[b"A" * 4096]]) == [True]
    put = Blocked(path, store, [key("b")], [[b"B" * 4096]])
    out = bytearray(4096)
    assert path.get_many([key("a")], [[out]]) == [True]
    assert bytes(out) == b"A" * 4096
    assert put.still_blocked()
    assert put.finish() == [True]


def test_a_get_of_a_page_whose_put_is_not_done_is_a_miss_never_partial(rig) -> None:
    store, path = rig
    put = Blocked(path, store, [key("c")], [[b"C" * 4096]])
    out = bytearray(b"\xa5" * 4096)
    assert path.get_many([key("c")], [[out]]) == [False]
    assert bytes(out) == b"\xa5" * 4096            # untouched
    assert put.still_blocked()
    assert put.finish() == [True]
    assert path.get_many([key("c")], [[out]]) == [True]
    assert bytes(out) == b"C" * 4096


def test_a_promotion_runs_on_the_read_lane(rig) -> None:
    """A tiered store's promotion is a put on a get's path: it does not queue behind write-backs."""
    store, path = rig
    put = Blocked(path, store, [key("d")], [[b"D" * 4096]])
    store.block.clear()                  # only the write-back blocks
    assert path.promote_many([key("e")], [[b"E" * 4096]]) == [True]
    assert put.still_blocked()
    put.finish()
    out = bytearray(4096)
    assert path.get_many([key("e")], [[out]]) == [True] and bytes(out) == b"E" * 4096


def test_a_gpu_page_get_returns_while_a_put_is_blocked(rig) -> None:
    """The GPU stager's store calls take the same lanes (the CPU stand-in of CUDA)."""
    torch = pytest.importorskip("torch")
    store, path = rig
    src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    assert path.put_many([key("g")], [[OnGpu(src)]]) == [True]
    put = Blocked(path, store, [key("h")], [[OnGpu(src.clone())]])
    dst = OnGpu(torch.zeros_like(src))
    assert path.get_many([key("g")], [[dst]]) == [True]
    assert torch.equal(dst.tensor, src)
    assert put.still_blocked()
    assert put.finish() == [True]


def test_the_write_lane_is_bounded(rig) -> None:
    store, _ = rig
    path = CpuStagingPath(store, write_queue_bytes=3 * 4096)
    try:
        # a put larger than the bound is taken when the lane is empty
        put = Blocked(path, store, [key("big1"), key("big2"), key("big3"), key("big4")],
                      [[b"x" * 4096]] * 4)
        # the lane holds 4 pages of 4 KiB, past the bound: the next put is refused at once,
        # every page not stored, while the first is still stuck
        assert path.put_many([key("r1"), key("r2")], [[b"r" * 4096]] * 2) == [False, False]
        assert put.still_blocked()
        assert path.stats().extra["write_lane_refused"] == 2
        assert put.finish() == [True] * 4
        assert path.exists_many([key("r1"), key("big4")]) == [False, True]
        # once the lane is empty a put is taken again
        store.block.clear()
        assert path.put_many([key("r1")], [[b"r" * 4096]]) == [True]
    finally:
        path.close()


def test_a_put_that_fits_the_bound_queues_behind_the_running_one(rig) -> None:
    store, _ = rig
    path = CpuStagingPath(store, write_queue_bytes=3 * 4096)
    try:
        put = Blocked(path, store, [key("q1")], [[b"1" * 4096]])
        second: list[list[bool]] = []
        t = threading.Thread(target=lambda: second.append(
            path.put_many([key("q2"), key("q3")], [[b"2" * 4096]] * 2)), daemon=True)
        t.start()
        deadline = time.monotonic() + WAIT_S      # until the second put is queued on the lane
        while path._writes.held < 3 * 4096 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert path._writes.held == 3 * 4096
        assert put.still_blocked()
        assert put.finish() == [True]
        t.join(WAIT_S)
        assert second == [[True, True]]
        assert path.stats().extra["write_lane_refused"] == 0
    finally:
        path.close()


def test_both_lanes_are_pinned_to_the_node(tmp_path: Path) -> None:
    from tests.transfer.numa import fake_numa

    mine = sorted(os.sched_getaffinity(0))
    root = fake_numa(tmp_path, {0: str(mine[0]), 1: ",".join(map(str, mine[1:])) or "999"})
    store = BlockingStore()
    path = CpuStagingPath(store, numa_node=0, root=root)
    try:
        assert path.put_many([key("p")], [[b"p" * 64]]) == [True]
        assert path.get_many([key("p")], [[bytearray(64)]]) == [True]
        assert store.affinity == {"put": {mine[0]}, "get": {mine[0]}}
        assert os.sched_getaffinity(0) == set(mine)
    finally:
        path.close()


class Clock:
    """A clock the test moves by hand (the budget's rate, never the machine's time)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_write_backs_past_the_budget_are_skipped_and_reads_go_on() -> None:
    """`offload.transfer.write_budget`: a put arriving with credit is taken whole (even past the
    credit), one arriving in debt is skipped, every page not stored and counted; credit comes back
    at the budget's rate, at most one second of it; gets never touch the budget."""
    from offload.transfer.cpu_staging import WriteBudget

    clock = Clock()
    store = MemoryStore()
    path = CpuStagingPath(store, write_budget=WriteBudget(8 * 4096, clock))
    try:
        page = [b"p" * 4096]
        assert path.put_many([key(f"a{i}") for i in range(12)], [page] * 12) == [True] * 12
        # 12 pages on 8 pages of credit: in debt by 4 pages, the next write-back is skipped
        assert path.put_many([key("s1"), key("s2")], [page] * 2) == [False, False]
        assert path.stats().extra["write_budget_skipped"] == 2
        assert path.exists_many([key("a11"), key("s1")]) == [True, False]
        dst = bytearray(4096)
        assert path.get_many([key("a0")], [[dst]]) == [True]   # reads never wait on the budget
        clock.now += 0.25          # 2 pages of credit back: still 2 pages in debt
        assert path.put_many([key("s3")], [page]) == [False]
        clock.now += 0.5           # 4 more: 2 pages of credit, a 3-page put is taken whole
        assert path.put_many([key(f"b{i}") for i in range(3)], [page] * 3) == [True] * 3
        clock.now += 3600          # an idle hour gives back one second of credit, not an hour's
        assert path.put_many([key(f"c{i}") for i in range(9)], [page] * 9) == [True] * 9
        assert path.put_many([key("s4")], [page]) == [False]
        assert path.stats().extra["write_budget_skipped"] == 4
    finally:
        path.close()


def test_the_write_budget_comes_from_the_config(tmp_path: Path) -> None:
    from offload.config import load_offload

    cfg = load_offload({"store": {"path": str(tmp_path / "c"), "capacity": "64MiB"},
                        "transfer": {"path": "cpu", "write_budget": "2GiB"}})
    path = CpuStagingPath.open(cfg)
    try:
        assert path._writes.budget is not None and path._writes.budget.rate == 2 << 30
    finally:
        path.close()
    cfg = load_offload({"store": {"path": str(tmp_path / "c"), "capacity": "64MiB"}})
    path = CpuStagingPath.open(cfg)
    try:
        assert path._writes.budget is None
    finally:
        path.close()
