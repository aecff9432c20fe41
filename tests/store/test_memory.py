"""MemoryStore: LRU under the cap, slot reuse, reserve arena, failure switches, vectored I/O."""

from __future__ import annotations

import threading
import time

import pytest

from offload.store.base import Slot, SlotStore, get_bytes
from offload.store.faults import FaultyMemoryStore
from offload.store.memory.store import MemoryStore
from tests.store.blocks import data, key

KiB = 1024


@pytest.mark.parametrize("prealloc", [False, True])
def test_lru_eviction_under_capacity_and_slot_reuse(prealloc: bool) -> None:
    s = MemoryStore(capacity=4 * 64 * KiB, reserve=prealloc * (1 << 20))
    keys = [key(i) for i in range(10)]
    for k in keys[:4]:
        assert s.put_many([k], [[data(k, 64 * KiB)]]) == [True]
    assert s.get_many([keys[0]], [[bytearray(64 * KiB)]]) == [True]   # keys[0] now recent
    assert s.put_many(keys[4:6], [[data(k, 64 * KiB)] for k in keys[4:6]]) == [True, True]
    assert s.exists_many(keys[:6]) == [True, False, False, True, True, True]
    for k in (keys[0], *keys[3:6]):
        assert get_bytes(s, k, 64 * KiB) == data(k, 64 * KiB)
    st = s.stats()
    assert st.blocks == 4 and st.bytes_used == 4 * 64 * KiB and st.evictions == 2
    assert st.extra["recycled_slots"] == 2 and st.extra["spare_bytes"] == 0
    assert s.delete_many(keys[:6]) == 4 and s.stats().bytes_used == 0
    s.close()


def test_vectored_blocks_and_size_mismatch() -> None:
    s = MemoryStore(capacity=1 << 20)
    k = key(1)
    blob = data(k, 3000)
    parts = [blob[:1000], bytearray(blob[1000:2500]), memoryview(blob)[2500:]]
    assert s.put_many([k], [parts]) == [True]
    a, b = bytearray(1200), bytearray(1800)
    assert s.get_many([k], [[a, memoryview(b)]]) == [True] and bytes(a + b) == blob
    assert s.get_many([k], [[bytearray(2999)]]) == [False]                # wrong size: miss
    assert s.put_many([k], [[b"x" * 10]]) == [True]                       # present: no write
    assert get_bytes(s, k, 3000) == blob


def test_mixed_sizes_stay_within_capacity() -> None:
    cap = 256 * KiB
    s = MemoryStore(capacity=cap)
    for i in range(40):
        size = (16, 48, 100, 32)[i % 4] * KiB
        k = key(i)
        assert s.put_many([k], [[data(k, size)]]) == [True]
        st = s.stats()
        assert st.bytes_used <= cap and st.bytes_used + st.extra["spare_bytes"] <= cap
        assert get_bytes(s, k, size) == data(k, size)
    assert s.put_many([key(99)], [[bytes(cap + 1)]]) == [False]           # larger than the cap


def test_reserve_arena_mixed_sizes_and_clear() -> None:
    cap = 256 * KiB
    s = MemoryStore(capacity=cap, reserve=64 * KiB)
    for i in range(30):
        size = (20, 60, 8)[i % 3] * KiB
        k = key(i)
        assert s.put_many([k], [[data(k, size)]]) == [True]
        assert get_bytes(s, k, size) == data(k, size)
        st = s.stats()
        assert st.bytes_used <= cap
    n = s.stats().blocks
    assert n > 0 and s.clear() == n and s.stats().blocks == 0
    k = key(1000)
    assert s.put_many([k], [[data(k, 200 * KiB)]]) == [True]
    assert get_bytes(s, k, 200 * KiB) == data(k, 200 * KiB)
    s.close()


def _wait_spare(s: MemoryStore, want: int) -> int:
    for _ in range(500):
        spare = int(s.stats().extra["spare_bytes"])
        if spare >= want:
            break
        time.sleep(0.01)
    return spare


def test_reserve_is_faulted_in_ahead_of_the_fill_point() -> None:
    s = MemoryStore(capacity=16 << 20, reserve=4 << 20)
    assert _wait_spare(s, 4 << 20) == 4 << 20
    k = key(7)
    assert s.put_many([k], [[data(k, 3 << 20)]]) == [True]
    assert _wait_spare(s, 4 << 20) == 4 << 20          # refilled past the new fill point
    assert get_bytes(s, k, 3 << 20) == data(k, 3 << 20)
    s.close()


def test_failure_switches_and_clear_namespace() -> None:
    s = FaultyMemoryStore()
    k1, k2 = key(1), key(2)
    s.fail_writes.add(k1)
    assert s.put_many([k1, k2], [[b"a" * 10], [b"b" * 10]]) == [False, True]
    s.fail_reads.add(k2)
    assert s.get_many([k2], [[bytearray(10)]]) == [False]
    s.fail_reads.clear()
    assert get_bytes(s, k2, 10) == b"b" * 10
    assert s.clear(b"\0" * 16) == 0 and s.clear(k2[:16]) == 1
    assert s.stats().put_skipped == 1 and s.stats().misses == 1
    s.fail_reads.add(k2)
    s.fail_writes.add(k1)
    assert s.pin_slots([k1, k2]) == [None, None] and s.reserve_slots([k1], [10]) == [None]
    assert s.stats().misses == 3
    assert not hasattr(MemoryStore(), "fail_reads"), "the production DRAM tier has no switches"


def test_threads_share_one_store() -> None:
    s = MemoryStore(capacity=64 * 4 * KiB)
    errors: list[str] = []

    def work(t: int) -> None:
        for i in range(50):
            k = key(t * 1000 + i)
            s.put_many([k], [[data(k, 4 * KiB)]])
            got = get_bytes(s, k, 4 * KiB)
            if got is not None and got != data(k, 4 * KiB):
                errors.append(f"thread {t} block {i} corrupt")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and s.stats().bytes_used <= 64 * 4 * KiB


# ---------------------------------------------------------------- slot API (zero-copy movers)
@pytest.mark.parametrize("arena", [False, True])
def test_pinned_block_is_never_evicted_nor_its_slot_reused(arena: bool) -> None:
    s = MemoryStore(capacity=4 * 64 * KiB, reserve=arena * (1 << 20))
    keys = [key(i) for i in range(12)]
    for k in keys[:4]:
        assert s.put_many([k], [[data(k, 64 * KiB)]]) == [True]
    (slot,) = s.pin_slots([keys[0]])                # keys[0] is the least recently used
    assert slot is not None and slot.view is not None
    view = slot.view
    assert bytes(view) == data(keys[0], 64 * KiB)
    for k in keys[4:8]:                              # a full store's worth of new blocks
        assert s.put_many([k], [[data(k, 64 * KiB)]]) == [True]
    assert s.exists_many(keys[:1]) == [True]         # eviction passed over the pinned block
    assert bytes(view) == data(keys[0], 64 * KiB)
    assert s.delete_many(keys[:1]) == 1              # deleted while pinned: gone from the index,
    assert s.exists_many(keys[:1]) == [False]
    for k in keys[8:12]:                             # but its slot is not handed out again
        assert s.put_many([k], [[data(k, 64 * KiB)]]) == [True]
    assert bytes(view) == data(keys[0], 64 * KiB)
    recycled = s.stats().extra["recycled_slots"]
    s.unpin_slots([slot])
    assert s.put_many([key(99)], [[data(key(99), 64 * KiB)]]) == [True]
    assert s.stats().extra["recycled_slots"] == recycled + 1   # the unpinned slot came back
    s.close()


def test_unpin_makes_a_block_evictable_again_and_counts_reads() -> None:
    s = MemoryStore(capacity=2 * 64 * KiB)
    a, b, c = key(1), key(2), key(3)
    assert s.put_many([a, b], [[data(a, 64 * KiB)], [data(b, 64 * KiB)]]) == [True, True]
    pinned = s.pin_slots([a, key(7)])
    assert [v is not None for v in pinned] == [True, False]
    s.unpin_slots([p for p in pinned if p is not None], [True])
    assert s.stats().hits == 1 and s.stats().misses == 1
    assert s.put_many([c], [[data(c, 64 * KiB)]]) == [True]
    assert s.exists_many([a, b, c]) == [True, False, True]   # b was least recently used
    assert s.put_many([key(4)], [[data(key(4), 64 * KiB)]]) == [True]
    assert s.exists_many([a]) == [False]                     # a is evictable once unpinned
    s.close()


def test_all_pinned_means_a_put_is_skipped_not_forced() -> None:
    s = MemoryStore(capacity=2 * 64 * KiB)
    ks = [key(i) for i in range(3)]
    assert s.put_many(ks[:2], [[data(k, 64 * KiB)] for k in ks[:2]]) == [True, True]
    pinned = [p for p in s.pin_slots(ks[:2]) if p is not None]
    assert s.put_many(ks[2:], [[data(ks[2], 64 * KiB)]]) == [False]
    assert s.reserve_slots(ks[2:], [64 * KiB]) == [None]
    s.unpin_slots(pinned)
    assert s.put_many(ks[2:], [[data(ks[2], 64 * KiB)]]) == [True]
    s.close()


@pytest.mark.parametrize("arena", [False, True])
def test_reserved_slot_is_invisible_until_committed_and_freed_on_abort(arena: bool) -> None:
    s = MemoryStore(capacity=4 * 64 * KiB, reserve=arena * (1 << 20))
    a, b = key(1), key(2)
    sa, sb = s.reserve_slots([a, b], [64 * KiB, 64 * KiB])
    assert sa is not None and sb is not None and sa.view is not None and sb.view is not None
    assert s.reserve_slots([a], [64 * KiB]) == [None]          # already being written
    sa.view[:] = data(a, 64 * KiB)
    sb.view[:] = data(b, 64 * KiB)
    assert s.exists_many([a, b]) == [False, False]
    assert s.get_many([a], [[bytearray(64 * KiB)]]) == [False]
    assert s.commit_slots([sa]) == [True]
    s.abort_slots([sb])
    assert s.exists_many([a, b]) == [True, False]
    assert get_bytes(s, a, 64 * KiB) == data(a, 64 * KiB)
    st = s.stats()
    assert st.blocks == 1 and st.bytes_used == 64 * KiB and st.puts == 1
    assert s.reserve_slots([a], [64 * KiB]) == [None]          # stored: nothing to write
    assert s.put_many([b], [[data(b, 64 * KiB)]]) == [True]    # reuses b's aborted slot
    assert s.stats().extra["recycled_slots"] == 1
    assert get_bytes(s, b, 64 * KiB) == data(b, 64 * KiB)
    assert s.commit_slots([Slot(key(9), 64 * KiB)]) == [False]  # never reserved
    s.close()


def test_reserve_counts_against_capacity_and_commit_after_a_racing_put() -> None:
    s = MemoryStore(capacity=2 * 64 * KiB)
    a, b, c = key(1), key(2), key(3)
    assert s.put_many([a], [[data(a, 64 * KiB)]]) == [True]
    (vb,) = s.reserve_slots([b], [64 * KiB])
    assert vb is not None
    assert s.put_many([c], [[data(c, 64 * KiB)]]) == [True]    # evicts a, not the reservation
    assert s.exists_many([a, c]) == [False, True]
    assert s.stats().bytes_used == 2 * 64 * KiB
    s.delete_many([c])
    assert s.put_many([b], [[data(b, 64 * KiB)]]) == [True]    # another writer got there first
    assert s.commit_slots([vb]) == [True]                      # still stored once
    assert s.stats().bytes_used == 64 * KiB and s.stats().blocks == 1
    s.close()


def test_memory_store_is_a_slot_store_of_memory_slots() -> None:
    s = MemoryStore(capacity=64 * KiB)
    assert isinstance(s, SlotStore) and s.slot_medium == "memory"
    assert set(s.tier_stats()) == {"local"}
    s.close()


@pytest.mark.parametrize("arena", [False, True])
def test_a_block_overwritten_in_place_is_a_miss_dropped_and_counted(arena: bool) -> None:
    """Issue 18: a late NIXL transfer landing in a stored block's slot must never be served."""
    s = MemoryStore(capacity=1 << 20, reserve=arena * (256 * KiB))
    a, b, c = key(1), key(2), key(3)
    assert s.put_many([a, b], [[data(a, 8 * KiB)], [data(b, 8 * KiB)]]) == [True, True]
    (slot,) = s.reserve_slots([c], [8 * KiB])
    assert slot is not None and slot.view is not None
    slot.view[:] = data(c, 8 * KiB)
    assert s.commit_slots([slot]) == [True]
    # Bytes land in the stored slots afterwards (as an aborted transfer's could).
    s._blocks[a][100:104] = b"EVIL"          # noqa: SLF001 - the memory a late transfer reaches
    s._blocks[c][0:4] = b"EVIL"              # noqa: SLF001
    buf = bytearray(8 * KiB)
    assert s.get_many([a, b], [[buf], [bytearray(8 * KiB)]]) == [False, True]
    assert bytes(buf) == bytes(8 * KiB), "a corrupted block reached its reader"
    assert s.pin_slots([c]) == [None]
    st = s.stats()
    assert st.checksum_failures == 2 and st.blocks == 1 and st.bytes_used == 8 * KiB
    assert s.exists_many([a, b, c]) == [False, True, False]
    # The key can be stored again, with its right bytes.
    assert s.put_many([a], [[data(a, 8 * KiB)]]) == [True]
    assert get_bytes(s, a, 8 * KiB) == data(a, 8 * KiB)
    s.close()
