"""The cpu path: NUMA pinning of the thread that drives the store, and pages through a real store."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from offload.hw.numa import node_cpus, numa_nodes, parse_cpulist
from offload.store.memory.store import MemoryStore
from offload.transfer.cpu_staging import CpuStagingPath, pinning_for
from tests.store.stores import open_store
from tests.transfer.numa import fake_numa


def test_parse_cpulist() -> None:
    assert parse_cpulist("0-3,8-11\n") == {0, 1, 2, 3, 8, 9, 10, 11}
    assert parse_cpulist("5") == {5}
    assert parse_cpulist("") == set()


def test_numa_topology_from_a_fixture_tree(tmp_path: Path) -> None:
    root = fake_numa(tmp_path, {0: "0-1", 1: "2-3"})
    assert numa_nodes(root) == [0, 1]
    assert node_cpus(1, root) == {2, 3}
    assert node_cpus(7, root) == set()


class AffinityStore(MemoryStore):
    """Records the CPU set of the thread that calls it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[set[int]] = []

    def put_many(self, keys, blocks):
        self.seen.append(os.sched_getaffinity(0))
        return super().put_many(keys, blocks)


def test_store_calls_run_pinned_to_the_node(tmp_path: Path) -> None:
    mine = sorted(os.sched_getaffinity(0))
    root = fake_numa(tmp_path, {0: str(mine[0]), 1: ",".join(map(str, mine[1:])) or "999"})
    store = AffinityStore()
    path = CpuStagingPath(store, numa_node=0, root=root)
    assert path.put_many([b"k" * 32], [[b"data"]]) == [True]
    assert store.seen == [{mine[0]}]
    assert os.sched_getaffinity(0) == set(mine)      # the caller's own thread is untouched
    assert path.stats().extra["pinned_cpus"] == 1
    path.close()


def test_no_pinning_on_one_node_or_unknown_node(tmp_path: Path) -> None:
    one = fake_numa(tmp_path / "one", {0: "0-1"})
    assert pinning_for(0, one) is None
    two = fake_numa(tmp_path / "two", {0: "0", 1: "1"})
    assert pinning_for(None, two) is None
    assert pinning_for(5, two) is None


def test_pages_through_the_disk_store_byte_identical(tmp_path: Path) -> None:
    store = open_store(tmp_path / "s", 64 << 20)
    path = CpuStagingPath(store, numa_node=0)
    pool = np.random.default_rng(0).integers(0, 255, size=(8, 2, 8192), dtype=np.uint8)
    out = np.zeros_like(pool)
    keys = [bytes([i]) * 32 for i in range(8)]
    try:
        assert path.put_many(keys, [[pool[i, 0], pool[i, 1]] for i in range(8)]) == [True] * 8
        assert path.get_many(keys, [[out[i, 0], out[i, 1]] for i in range(8)]) == [True] * 8
        assert np.array_equal(pool, out)
        assert path.exists_many(keys[:1] + [b"x" * 32]) == [True, False]
    finally:
        path.close()


@pytest.mark.gpu
def test_gpu_pages_are_staged_double_buffered(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU with CUDA")
    store = open_store(tmp_path / "s", 1 << 30)
    path = CpuStagingPath(store)
    src = torch.randint(0, 255, (40, 2, 4 << 20), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    keys = [i.to_bytes(32, "big") for i in range(40)]
    try:
        assert path.put_many(keys, [[src[i, 0], src[i, 1]] for i in range(40)]) == [True] * 40
        assert path.get_many(keys, [[dst[i, 0], dst[i, 1]] for i in range(40)]) == [True] * 40
        torch.cuda.synchronize()
        assert torch.equal(src, dst)
    finally:
        path.close()
