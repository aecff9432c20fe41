"""Property-based tests of the disk store's index (hypothesis state machines over real files)."""

from __future__ import annotations

import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from offload.store.base import get_bytes
from tests.store.blocks import data, key
from tests.store.stores import open_store

pytestmark = pytest.mark.slow

KEYS = st.integers(min_value=0, max_value=15)
SIZES = st.sampled_from([1, 4096, 5000, 12288])


def size_of(i: int, variant: int) -> int:
    return [1, 4096, 5000, 12288][(i + variant) % 4]


class IndexModel(RuleBasedStateMachine):
    """Without capacity pressure the store behaves exactly like a dict, across reopens."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="sglo-prop-")
        self.store = open_store(self.dir, capacity=1 << 30, io_threads=2)
        self.model: dict[int, int] = {}  # key index -> size

    @rule(i=KEYS, size=SIZES)
    def put(self, i: int, size: int) -> None:
        size = self.model.get(i, size)  # a stored block keeps its bytes: a re-put is a no-op
        assert self.store.put_many([key(i)], [[data(key(i), size)]]) == [True]
        self.model[i] = size

    @rule(items=st.lists(st.tuples(KEYS, SIZES), min_size=1, max_size=6))
    def put_batch(self, items: list[tuple[int, int]]) -> None:
        sizes = {}
        for i, size in items:
            sizes.setdefault(i, self.model.get(i, size))
        ks = [key(i) for i, _ in items]
        blocks = [[data(key(i), sizes[i])] for i, _ in items]
        assert self.store.put_many(ks, blocks) == [True] * len(items)
        self.model.update(sizes)

    @rule(ids=st.lists(KEYS, max_size=5))
    def delete(self, ids: list[int]) -> None:
        n = self.store.delete_many([key(i) for i in ids])
        assert n == len({i for i in ids if i in self.model})
        for i in ids:
            self.model.pop(i, None)

    @rule(i=KEYS)
    def get(self, i: int) -> None:
        if i in self.model:
            assert get_bytes(self.store, key(i), self.model[i]) == data(key(i), self.model[i])
        else:
            assert get_bytes(self.store, key(i), 4096) is None

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = open_store(self.dir, capacity=1 << 30, io_threads=2)

    @invariant()
    def exists_matches_model(self) -> None:
        got = self.store.exists_many([key(i) for i in range(16)])
        assert got == [i in self.model for i in range(16)]

    @invariant()
    def accounting(self) -> None:
        st_ = self.store.stats()
        assert st_.blocks == len(self.model)
        used = st_.bytes_used            # stored (the range ahead apart)
        assert used == sum(4096 + -(-s // 4096) * 4096 for s in self.model.values())

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class CappedModel(RuleBasedStateMachine):
    """Under a small cap: never above it, never wrong bytes, evictions only of real blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="sglo-cap-")
        self.cap = 10 * 8192
        self.store = open_store(self.dir, capacity=self.cap, io_threads=2)
        self.ever: set[int] = set()

    @rule(i=st.integers(0, 40))
    def put(self, i: int) -> None:
        self.store.put_many([key(i)], [[data(key(i), 4096)]])
        self.ever.add(i)

    @precondition(lambda self: self.ever)
    @rule(i=st.integers(0, 40))
    def get(self, i: int) -> None:
        got = get_bytes(self.store, key(i), 4096)
        assert got is None or got == data(key(i), 4096)

    @rule(to=st.integers(0, 10 * 8192))
    def evict(self, to: int) -> None:
        self.store.evict_to(to)
        assert self.store.stats().bytes_used <= to

    @invariant()
    def under_cap_and_only_real_blocks(self) -> None:
        assert self.store.stats().bytes_used <= self.cap
        present = self.store.exists_many([key(i) for i in range(41)])
        assert {i for i, p in enumerate(present) if p} <= self.ever

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


_settings = settings(max_examples=25, stateful_step_count=25, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestIndexModel = _settings(IndexModel).TestCase
TestCappedModel = _settings(CappedModel).TestCase
