"""Slot access (the GDS path's view of the store), exercised on the CPU with plain file writes."""

from __future__ import annotations

import os

from offload.store.base import Slot, SlotStore, get_bytes
from offload.store.disk.slab import format as slot_format
from tests.store.blocks import data, key
from tests.store.stores import open_store


def _write_like_gds(slot, payload: bytes) -> None:
    fd = os.open(slot.path, os.O_WRONLY)
    try:
        os.pwrite(fd, payload, slot.offset)
    finally:
        os.close(fd)


def test_reserved_slot_written_elsewhere_is_verified_with_wsum64(tmp_path):
    size = 3 * 4096 + 5
    with open_store(tmp_path) as s:
        ks = [key(i) for i in range(3)]
        slots = s.reserve_slots(ks, [size] * 3)
        assert all(x is not None and x.offset % 4096 == 0 for x in slots)
        assert s.exists_many(ks) == [False] * 3  # not visible before commit
        for sl in slots:
            _write_like_gds(sl, data(sl.key, size))
        sums = [slot_format.wsum64([data(k, size)]) for k in ks]
        sums[2] ^= 1  # the path computed a wrong checksum for block 2
        assert s.commit_slots(slots, sums) == [True] * 3
        assert get_bytes(s, ks[0], size) == data(ks[0], size)
        assert get_bytes(s, ks[2], size) is None  # never served: checksum mismatch
        located = s.pin_slots([ks[1], key(9)])
        assert located[0] is not None and located[0].checksum == sums[1] and located[1] is None
        s.unpin_slots([located[0]])
        assert s.reserve_slots([ks[0]], [size]) == [None]  # already stored


def test_aborted_slots_are_freed(tmp_path):
    with open_store(tmp_path, capacity=1 << 20) as s:
        slots = s.reserve_slots([key(1), key(2)], [100_000, 100_000])
        used = s.stats().bytes_used
        assert used > 0
        s.abort_slots(slots)
        assert s.stats().bytes_used == 0 and s.exists_many([key(1)]) == [False]


def test_wsum64_matches_the_gds_module():
    from offload.transfer.gds import wsum64_numpy

    buf = os.urandom(1000)
    assert wsum64_numpy(buf) == slot_format.wsum64([buf]) == slot_format.wsum64([buf[:300], buf[300:]])


def test_disk_store_is_a_slot_store_of_file_slots(tmp_path):
    with open_store(tmp_path) as s:
        assert isinstance(s, SlotStore) and s.slot_medium == "file" and s.arena_region() is None
        assert set(s.tier_stats()) == {"local"}


def test_commit_without_checksums_reads_them_from_the_file(tmp_path):
    size = 2 * 4096 + 7
    with open_store(tmp_path) as s:
        (slot,) = s.reserve_slots([key(1)], [size])
        _write_like_gds(slot, data(key(1), size))
        assert s.commit_slots([slot]) == [True]
        assert get_bytes(s, key(1), size) == data(key(1), size)


def test_pinned_reads_count_as_hits_and_absent_keys_as_misses(tmp_path):
    size = 4096
    with open_store(tmp_path) as s:
        assert s.put_many([key(1)], [[data(key(1), size)]]) == [True]
        before = s.stats()
        pinned = s.pin_slots([key(1), key(2)])
        assert pinned[0] is not None and pinned[1] is None
        s.unpin_slots([pinned[0]], [True])
        after = s.stats()
        assert (after.hits - before.hits, after.misses - before.misses) == (1, 1)
        assert after.bytes_read - before.bytes_read == size


def test_slot_failures_are_misses_not_exceptions(tmp_path):
    with open_store(tmp_path) as s:
        bogus = Slot(key(1), 4096, path=str(tmp_path / "not-a-slab"), offset=4096)
        assert s.commit_slots([bogus], [0]) == [False]
        s.abort_slots([bogus])                      # logged, not raised
