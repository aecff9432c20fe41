"""Slot access (the GDS path's view of the store), exercised on the CPU with plain file writes."""

from __future__ import annotations

import os

from offload.store import slab
from offload.store.base import get_bytes
from tests.store.blocks import data, key
from tests.store.test_disk import open_store


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
        sums = [slab.wsum64([data(k, size)]) for k in ks]
        sums[2] ^= 1  # the path computed a wrong checksum for block 2
        assert s.commit_slots(slots, sums) == [True] * 3
        assert get_bytes(s, ks[0], size) == data(ks[0], size)
        assert get_bytes(s, ks[2], size) is None  # never served: checksum mismatch
        located = s.locate_many([ks[1], key(9)])
        assert located[0] is not None and located[0].checksum == sums[1] and located[1] is None
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
    assert wsum64_numpy(buf) == slab.wsum64([buf]) == slab.wsum64([buf[:300], buf[300:]])
