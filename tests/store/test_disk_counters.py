"""What the disk store tells its operator: a failed read of a row put again meanwhile keeps the key
(the new row stays a stored block) and counts as a reused slot, not a checksum failure; and
damaged index rows and busy index waits are typed `stats()` fields exported as Prometheus
counters."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry

from offload.metrics import StoreWatch, TierMetrics
from offload.store.disk.index.db import Location
from tests.store.blocks import key
from tests.store.rows import HOSTILE, SIZE, edit_rows, exact, put
from tests.store.stores import open_store


def test_a_corrupt_read_of_a_kept_row_leaves_the_key_stored(tmp_path, monkeypatch):
    """The read used a location that is not the row the index holds now (the block was put again
    into its slot meanwhile): the row is kept, so the process must go on reporting the key."""
    with open_store(tmp_path / "cache") as s:
        assert put(s, range(2)) == [True] * 2
        assert s.exists_many([key(0), key(1)]) == [True, True]   # key set up to date
        real = s._state.ix.reader.locate

        def stale(keys: list[bytes]) -> dict[bytes, Location]:   # the read before the re-put
            got = real(keys)
            loc = got[key(1)]
            got[key(1)] = dataclasses.replace(loc, csum=loc.csum ^ 1, created=loc.created - 1)
            return got

        monkeypatch.setattr(s._state.ix.reader, "locate", stale)
        assert s.get_many([key(0), key(1)], [[bytearray(SIZE)], [bytearray(SIZE)]]) == [True, False]
        monkeypatch.setattr(s._state.ix.reader, "locate", real)
        st = s.stats()   # reused under the read: a miss, not corruption
        assert st.checksum_failures == 0 and st.reused_reads == 1
        assert s.exists_many([key(0), key(1)]) == [True, True]   # the row was kept: still stored
        assert exact(s, [0, 1]) == [True, True]


def test_damaged_rows_and_busy_waits_are_typed_stats_and_metrics(tmp_path):
    d = tmp_path / "cache"
    with open_store(d) as s:
        assert put(s, range(8)) == [True] * 8
    edit_rows(d, HOSTILE)
    reg = CollectorRegistry()
    with open_store(d) as s:
        ks = [key(i) for i in range(8)]
        s.get_many(ks, [[bytearray(SIZE)] for _ in ks])
        s._state.ix.busy += 2                   # as two data-path waits past their deadline would
        st = s.stats()
        assert st.damaged_rows == len(HOSTILE) and st.index_busy == 2
        assert "index_busy" not in st.extra
        watch = StoreWatch(s, TierMetrics(reg))
        watch.poll()
        assert reg.get_sample_value("sglang_offload_damaged_rows_total",
                                    {"tier": "local"}) == len(HOSTILE)
        assert reg.get_sample_value("sglang_offload_index_busy_total", {"tier": "local"}) == 2
