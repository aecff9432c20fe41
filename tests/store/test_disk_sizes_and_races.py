"""Many block sizes from many processes under a small cap keep their data (the slots each process
holds ahead count against the cap but are sized to what it writes and reported apart); a read that
lands on a slot being deleted and reused by another process is a miss, not a checksum failure.
Real processes, real files."""

from __future__ import annotations

import pytest

from offload.store.disk.slab import format as slot_format
from tests.store.blocks import data, key
from tests.store.sharers import line, proc
from tests.store.stores import open_store

pytestmark = pytest.mark.slow

KiB = 1 << 10


def test_many_block_sizes_from_many_processes_under_a_small_cap_keep_their_data(tmp_path):
    """Four processes (TP ranks, each with sidecar pools of other sizes) put one block of each of
    80 sizes in all (4 KiB .. 320 KiB, ~13 MB of data) under a 64 MiB cap, and stay open."""
    d, stop = tmp_path / "cache", tmp_path / "stop"
    cap = 64 << 20
    sizes = [4 * KiB * (k + 1) for k in range(80)]
    with open_store(d, capacity=cap):
        pass
    ps = [proc("sizes", d, capacity=cap, first=20 * r, sizes=sizes[20 * r:20 * (r + 1)],
               stop=str(stop)) for r in range(4)]
    try:
        for p in ps:
            rec = line(p)
            assert rec["flushed"] and all(rec["ok"])
        with open_store(d, capacity=cap) as s:   # while all four hold their ranges
            st = s.stats()
            kept = [i for i, n in enumerate(sizes) if s.exists_many([key(i)])[0]]
            assert kept == list(range(80)), f"{80 - len(kept)} of 80 blocks evicted"
            assert st.bytes_used == sum(slot_format.slot_bytes_for(n) for n in sizes)
        stop.touch()
        assert all(p.wait(120) == 0 for p in ps)
    finally:
        for p in ps:
            p.kill()
    with open_store(d, capacity=cap) as s:
        for i, n in enumerate(sizes):
            buf = bytearray(n)
            assert s.get_many([key(i)], [[buf]]) == [True] and bytes(buf) == data(key(i), n)


def test_a_read_landing_on_a_slot_reused_by_another_process_is_not_corruption(tmp_path):
    d = tmp_path / "cache"
    size = 16 * KiB
    with open_store(d) as s:
        ks = [key(i) for i in range(16)]
        assert s.put_many(ks, [[data(k, size)] for k in ks]) == [True] * 16
    churn = proc("churn", d, n=16, seconds=8, size=size)
    reader = proc("reader", d, n=16, seconds=8, size=size)
    try:
        got, rounds = line(reader), line(churn)["rounds"]
        assert reader.wait(120) == 0 and churn.wait(120) == 0
    finally:
        churn.kill()
        reader.kill()
    assert rounds > 10 and got["misses"] > 0          # the race was run
    assert got["wrong"] == 0                          # never a wrong block
    assert got["checksum_failures"] == 0, got         # and no corruption alarm for it
    assert got["reused_reads"] > 0, got
