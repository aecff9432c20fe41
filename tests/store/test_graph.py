"""The store graph: `Composite.parts`, `walk` and `find` over real stores (offload/store/base.py)."""

from __future__ import annotations

from typing import Protocol

import pytest

from offload.store.base import (
    BlockStore,
    CommitsNow,
    Composite,
    Durable,
    Flushable,
    HasBacklog,
    RegistersRegions,
    SlotStore,
    find,
    walk,
)
from offload.store.disk.store import DiskStore
from offload.store.memory.store import MemoryStore
from offload.store.tiered import TieredStore, WriteThrough
from offload.transfer.cpu_staging import CpuStagingPath
from tests.store.stores import open_store


@pytest.fixture
def disk(tmp_path):
    s = open_store(tmp_path / "cache")
    yield s
    s.close()


def test_walk_is_the_store_then_its_parts_breadth_first(disk) -> None:
    path, shared = CpuStagingPath(disk), MemoryStore(1 << 20)
    tiered = TieredStore(path, shared, WriteThrough())
    try:
        assert [type(s) for s in walk(tiered)] == [TieredStore, CpuStagingPath, MemoryStore,
                                                   DiskStore]
        assert walk(tiered)[3] is disk and isinstance(tiered, Composite)
        assert walk(disk) == [disk] and not isinstance(disk, Composite)
    finally:
        path.close()


def test_a_store_reached_twice_is_walked_once(disk) -> None:
    path = CpuStagingPath(disk)
    tiered = TieredStore(path, disk, WriteThrough())     # the disk store under both tiers
    try:
        assert [s for s in walk(tiered) if s is disk] == [disk]
    finally:
        path.close()


def test_find_gives_the_parts_with_a_capability(disk) -> None:
    mem = MemoryStore(1 << 20)
    path = CpuStagingPath(disk)
    tiered = TieredStore(path, mem, WriteThrough())
    try:
        assert find(tiered, DiskStore) == [disk]
        assert find(tiered, CommitsNow) == [disk]
        assert find(tiered, Durable) == [path, disk]       # the path reports its store's
        assert find(tiered, SlotStore) == [mem, disk]
        assert find(tiered, RegistersRegions) == [tiered, path]
        assert tiered in find(tiered, Flushable) and tiered in find(tiered, HasBacklog)
        assert len(find(tiered, BlockStore)) == 4
        assert find(mem, Durable) == []
    finally:
        path.close()


def test_find_refuses_what_isinstance_cannot_ask() -> None:
    class NotCheckable(Protocol):
        def durable(self) -> None: ...

    with pytest.raises(TypeError):
        find(MemoryStore(1 << 20), NotCheckable)
    with pytest.raises(TypeError):
        find(MemoryStore(1 << 20), lambda s: s)
