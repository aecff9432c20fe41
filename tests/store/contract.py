"""The block-store contract, as one suite every tier runs (zarr-python's `StoreTests`).

`StoreContract` is a base test class: a subclass per tier (tests/store/test_contract*.py)
provides the `store` fixture (an empty store, closed at teardown) and says what it promises:
- `persistent`: blocks put and flushed survive `reopen(store)` (a new store on the same data).
- `supports_clear`: `clear()` works from this process (the agent's is done on its host).
- `buffer(nbytes)`: where a test's source and destination buffers come from (the agent's
  registered region, so its blocks move by NIXL; plain bytearrays elsewhere).
Every test uses only `BlockStore` and `offload.store.base` helpers, so a tier passes by keeping
the contract of base.py, not by matching another tier's internals.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator

import pytest

from offload.keys import Namespace
from offload.store.base import BlockStore, StoreStats, flush
from tests.store.redis_fixtures import block_bytes

SIZE = 16 << 10


class StoreContract:
    persistent = False
    supports_clear = True

    @pytest.fixture(autouse=True)
    def _namespaces(self) -> None:
        """This test's own namespace (a fresh salt: tests never meet in a shared store) and
        another tenant's: the same model and pages under another salt."""
        run = uuid.uuid4().hex
        self.ns = Namespace("contract-model", "bf16", "layer_first", 16, salt=run)
        self.other = Namespace("contract-model", "bf16", "layer_first", 16, salt=run + "-other")

    @pytest.fixture
    def store(self) -> Iterator[BlockStore]:
        raise NotImplementedError("each tier's subclass provides an empty store")

    def reopen(self, store: BlockStore) -> BlockStore:
        """A new store over the same data (only where `persistent`)."""
        raise NotImplementedError

    def buffer(self, nbytes: int) -> Any:
        return bytearray(nbytes)

    # -- helpers -----------------------------------------------------------------------------
    def block(self, page: str, size: int = SIZE, parts: int = 2) -> list[Any]:
        """The block of `page` as `parts` buffers (vectored, as SGLang's layer slices are)."""
        data = block_bytes(page, size)
        out, step = [], size // parts
        for i in range(parts):
            chunk = data[i * step:size if i == parts - 1 else (i + 1) * step]
            b = self.buffer(len(chunk))
            memoryview(b)[:] = chunk
            out.append(b)
        return out

    def dests(self, n: int, size: int = SIZE, parts: int = 2) -> list[list[Any]]:
        step = size // parts
        return [[self.buffer(step if i < parts - 1 else size - step * (parts - 1))
                 for i in range(parts)] for _ in range(n)]

    @staticmethod
    def joined(dest: list[Any]) -> bytes:
        return b"".join(bytes(memoryview(b)) for b in dest)

    def put(self, store: BlockStore, pages: list[str], ns: Namespace | None = None
            ) -> list[bytes]:
        ks = [(ns or self.ns).key(p) for p in pages]
        assert store.put_many(ks, [self.block(p) for p in pages]) == [True] * len(ks)
        assert flush(store)
        return ks

    # -- the contract ------------------------------------------------------------------------
    def test_put_get_exists_round_trip(self, store: BlockStore) -> None:
        pages = [f"rt-{i}" for i in range(6)]
        ks = self.put(store, pages)
        assert store.exists_many(ks) == [True] * 6
        dests = self.dests(6)
        assert store.get_many(ks, dests) == [True] * 6
        assert [self.joined(d) for d in dests] == [block_bytes(p, SIZE) for p in pages]

    def test_a_block_in_one_buffer_reads_into_many_and_back(self, store: BlockStore) -> None:
        ks = [self.ns.key("one")]
        assert store.put_many(ks, [self.block("one", parts=1)]) == [True]
        assert flush(store)
        dests = self.dests(1, parts=4)
        assert store.get_many(ks, dests) == [True]
        assert self.joined(dests[0]) == block_bytes("one", SIZE)

    def test_missing_keys_are_misses(self, store: BlockStore) -> None:
        ks = [self.ns.key(f"absent-{i}") for i in range(3)]
        assert store.exists_many(ks) == [False] * 3
        assert store.get_many(ks, self.dests(3)) == [False] * 3
        assert store.delete_many(ks) == 0

    def test_a_batch_succeeds_per_key(self, store: BlockStore) -> None:
        ks = self.put(store, ["b0", "b2"])
        batch = [ks[0], self.ns.key("b1"), ks[1], self.ns.key("b3")]
        assert store.exists_many(batch) == [True, False, True, False]
        dests = self.dests(4)
        assert store.get_many(batch, dests) == [True, False, True, False]
        assert self.joined(dests[0]) == block_bytes("b0", SIZE)
        assert self.joined(dests[2]) == block_bytes("b2", SIZE)

    def test_a_put_batch_succeeds_per_key(self, store: BlockStore) -> None:
        good = [self.ns.key("pb0"), self.ns.key("pb2")]
        batch = [good[0], self.ns.key("pb1")[:31], good[1]]
        blocks = [self.block("pb0"), self.block("pb1"), self.block("pb2")]
        assert store.put_many(batch, blocks) == [True, False, True]
        assert flush(store)
        dests = self.dests(2)
        assert store.get_many(good, dests) == [True, True]
        assert [self.joined(d) for d in dests] == [block_bytes(p, SIZE) for p in ("pb0", "pb2")]

    def test_putting_a_stored_key_again_succeeds_and_keeps_it(self, store: BlockStore) -> None:
        ks = self.put(store, ["again"])
        assert store.put_many(ks, [self.block("again")]) == [True]
        assert flush(store)
        dests = self.dests(1)
        assert store.get_many(ks, dests) == [True]
        assert self.joined(dests[0]) == block_bytes("again", SIZE)

    def test_empty_batches(self, store: BlockStore) -> None:
        assert store.put_many([], []) == []
        assert store.get_many([], []) == []
        assert store.exists_many([]) == []
        assert store.delete_many([]) == 0

    @pytest.mark.parametrize("delta", [-1, 1, 4096])
    def test_wrong_length_buffers_are_misses_and_lose_nothing(self, store: BlockStore,
                                                              delta: int) -> None:
        ks = self.put(store, ["len"])
        assert store.get_many(ks, self.dests(1, SIZE + delta)) == [False]
        dests = self.dests(1)
        assert store.get_many(ks, dests) == [True]
        assert self.joined(dests[0]) == block_bytes("len", SIZE)

    def test_a_key_of_the_wrong_length_is_refused_not_raised(self, store: BlockStore) -> None:
        short = self.ns.key("short")[:31]
        assert store.put_many([short], [self.block("short")]) == [False]
        assert store.get_many([short], self.dests(1)) == [False]
        assert store.exists_many([short]) == [False]

    def test_namespaces_and_salts_are_isolated(self, store: BlockStore) -> None:
        store.register_namespace(self.ns)
        store.register_namespace(self.other)
        mine = self.put(store, ["shared-page"])
        theirs = [self.other.key("shared-page")]
        assert mine != theirs
        assert store.exists_many(theirs) == [False]
        assert store.get_many(theirs, self.dests(1)) == [False]
        theirs = self.put(store, ["shared-page", "only-theirs"], self.other)
        assert store.exists_many(mine + theirs) == [True, True, True]
        if self.supports_clear:               # clearing one namespace leaves the other's
            assert store.clear(self.other.digest()) == 2
            assert store.exists_many(mine + theirs) == [True, False, False]
        dests = self.dests(1)
        assert store.get_many(mine, dests) == [True]
        assert self.joined(dests[0]) == block_bytes("shared-page", SIZE)

    def test_delete_and_clear(self, store: BlockStore) -> None:
        ks = self.put(store, [f"d{i}" for i in range(5)])
        assert store.delete_many(ks[:2]) == 2
        assert store.delete_many(ks[:2]) == 0
        assert store.exists_many(ks) == [False, False, True, True, True]
        assert store.get_many(ks[:1], self.dests(1)) == [False]
        assert self.put(store, ["d0"]) == ks[:1]          # a deleted key can be stored again
        dests = self.dests(1)
        assert store.get_many(ks[:1], dests) == [True]
        assert self.joined(dests[0]) == block_bytes("d0", SIZE)
        assert store.delete_many(ks[:1]) == 1
        if not self.supports_clear:
            return
        assert store.clear() == 3
        assert store.exists_many(ks) == [False] * 5
        again = self.put(store, ["after-clear"])          # still usable after a clear
        assert store.exists_many(again) == [True]

    def test_stats_are_typed_per_tier(self, store: BlockStore) -> None:
        self.put(store, ["s0"])
        store.get_many([self.ns.key("s0"), self.ns.key("s1")], self.dests(2))
        st = store.stats()
        assert isinstance(st, StoreStats) and st.hits >= 1 and st.misses >= 1
        tiers = store.tier_stats()
        assert tiers and all(isinstance(v, StoreStats) for v in tiers.values())

    def test_blocks_survive_a_reopen_where_promised(self, store: BlockStore) -> None:
        if not self.persistent:
            pytest.skip(f"{type(self).__name__}: not persistent (nothing promised after close)")
        pages = [f"p{i}" for i in range(4)]
        ks = self.put(store, pages)
        again = self.reopen(store)
        try:
            assert again.exists_many(ks) == [True] * 4
            dests = self.dests(4)
            assert again.get_many(ks, dests) == [True] * 4
            assert [self.joined(d) for d in dests] == [block_bytes(p, SIZE) for p in pages]
        finally:
            again.close()
