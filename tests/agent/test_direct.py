"""Zero-copy moves: with the DRAM tier NIXL moves blocks straight to/from the store's slots."""

from __future__ import annotations

import numpy as np
import pytest

from offload.store.memory.store import MemoryStore
from tests.agent.conftest import needs_nixl
from tests.agent.pages import DIM, HEADS, LAYERS, PAGE_TOKENS, client, host_pool, keys, page

pytestmark = pytest.mark.slow


def _roundtrip(store, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    src = host_pool(n, seed)
    dst = np.zeros((2, n * PAGE_TOKENS, LAYERS, HEADS, DIM), np.uint16)
    store.register_region(src)
    store.register_region(dst)
    ks = keys(n, f"s{seed}")
    assert store.put_many(ks, [page(src, i) for i in range(n)]) == [True] * n
    assert store.get_many(ks, [page(dst, i) for i in range(n)]) == [True] * n
    return src, dst


@needs_nixl
def test_memory_tier_moves_blocks_with_no_staging_copy(agent_factory) -> None:
    agent = agent_factory("--memory")
    store = client(agent)
    try:
        src, dst = _roundtrip(store, 8, 3)
        assert np.array_equal(src, dst)
        extra = store.stats().extra
        assert extra["agent_blocks_direct_in"] == 8 and extra["agent_blocks_direct_out"] == 8
        assert "agent_blocks_staged_in" not in extra and "agent_blocks_staged_out" not in extra
        page_bytes = 2 * PAGE_TOKENS * LAYERS * HEADS * DIM * 2
        assert extra["agent_bytes_nixl_in"] == extra["agent_bytes_nixl_out"] == 8 * page_bytes
        # Misses and blocks already stored behave as on the staging path.
        ks = keys(8, "s3") + keys(1, "absent")
        out = np.zeros_like(dst)
        flags = store.get_many(ks, [page(out, i % 8) for i in range(9)])
        assert flags == [True] * 8 + [False]
        assert store.put_many(keys(2, "s3"), [page(src, i) for i in range(2)]) == [True, True]
        assert store.stats().extra["agent_blocks_direct_in"] == 8      # not read again
    finally:
        store.close()


@needs_nixl
def test_disk_store_keeps_the_staging_path(agent_factory, tmp_path) -> None:
    pytest.importorskip("offload.store.disk.store")
    agent = agent_factory("--store", str(tmp_path / "store"), "--capacity", "64MiB")
    store = client(agent)
    try:
        src, dst = _roundtrip(store, 4, 5)
        assert np.array_equal(src, dst)
        extra = store.stats().extra
        assert extra["agent_blocks_staged_in"] == 4 and extra["agent_blocks_staged_out"] == 4
        assert "agent_blocks_direct_in" not in extra
    finally:
        store.close()


def test_arena_registers_chunks_lazily_and_splits_copies_at_their_seams() -> None:
    from offload.agent.mover import Arena

    class FakeMover:                 # NIXL registration recorded, not performed
        def __init__(self) -> None:
            self.regs: list[tuple[int, int]] = []

        def register(self, addr: int, size: int) -> tuple[int, int]:
            self.regs.append((addr, size))
            return (addr, size)

        def deregister(self, reg: object) -> None:
            self.regs.remove(reg)    # type: ignore[arg-type]

    m = FakeMover()
    a = Arena(m, 1 << 20, 10 << 10, chunk=4 << 10)     # type: ignore[arg-type]
    assert m.regs == []
    assert a.covers((1 << 20) + 100, 1000) and m.regs == [(1 << 20, 4 << 10)]
    assert a.covers((1 << 20) + 3000, 6000) and len(m.regs) == 3     # last chunk is 2 KiB
    assert m.regs[-1] == ((1 << 20) + (8 << 10), 2 << 10)
    assert not a.covers((1 << 20) + 9000, 2000) and not a.covers(100, 10)
    base = 1 << 20
    assert a.pieces(base + 3000, 7000, 6000) == [(base + 3000, 7000, 1096),
                                                 (base + 4096, 8096, 4096),
                                                 (base + 8192, 12192, 808)]
    a.close()
    assert m.regs == []


def test_memory_store_arena_region_only_in_arena_mode() -> None:
    plain, tier = MemoryStore(1 << 20), MemoryStore(1 << 20, reserve=64 << 10)
    try:
        assert plain.arena_region() is None
        region = tier.arena_region()
        assert region is not None and region[1] == 1 << 20
        (v,) = tier.reserve_slots([b"k" * 32], [4096])
        from offload.agent.nixl_util import region_of

        assert v is not None and v.view is not None
        addr, n = region_of(v.view)
        assert region[0] <= addr and addr + n <= region[0] + region[1]
    finally:
        plain.close()
        tier.close()


def test_quarantine_frees_memory_only_once_its_transfer_is_final() -> None:
    from offload.agent.quarantine import Quarantine

    class FakeAgent:                 # NIXL's transfer states, set by the test
        def __init__(self) -> None:
            self.state: dict[str, str] = {}
            self.released: list[str] = []

        def check_xfer_state(self, h: str) -> str:
            return self.state[h]

        def release_xfer_handle(self, h: str) -> None:
            self.released.append(h)

    agent, freed, order = FakeAgent(), [], []
    q = Quarantine(agent)
    agent.state = {"a": "PROC", "b": "PROC", "c": "PROC"}
    for h, peer in (("a", "p1"), ("b", "p1"), ("c", "p2")):
        q.hold(h, peer, 2, lambda h=h: freed.append(h))
    assert q.reap() == 0 and freed == [] and q.held() == 6
    agent.state["a"] = "ERR"                       # failed: final
    assert q.reap() == 2 and freed == ["a"] and agent.released == ["a"]
    # p2 torn down while "c" runs: nothing freed (UCX may still land it), the peer not forgotten
    # and the handle not released until NIXL says "c" is final; then the peer, then its memory.
    assert q.drop_peer("p2", lambda: order.append(list(freed))) == 0
    assert freed == ["a"] and order == [] and q.held() == 4 and agent.released == ["a"]
    agent.state["c"] = "DONE"
    assert q.reap() == 2
    assert freed == ["a", "c"] and order == [["a"]] and q.held() == 2 and q.total == 6
    agent.state["b"] = "DONE"
    assert q.reap() == 2 and freed == ["a", "c", "b"] and q.held() == 0
