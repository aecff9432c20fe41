"""Reserved ranges: a process's puts take slots it reserved ahead, with no index transaction of
their own; the range grows with what the process writes; the cap counts it (reported apart), a
dead process's range is reclaimed at the next open, and two processes storing one key both
succeed with one copy kept. Real files and a real second process."""

from __future__ import annotations

import os
import sqlite3

from offload.store.disk import writes as disk_write
from offload.store.disk.index.db import Index
from tests.store.blocks import key
from tests.store.stores import index_rows, open_store, worker
from tests.store.writes import SIZE, exact, put

SLOT = SIZE + 4096


def test_puts_take_the_reserved_range_without_an_index_transaction(tmp_path, monkeypatch):
    calls: list[int] = []
    real = Index.reserve

    def counting(self, *a, **kw):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(Index, "reserve", counting)
    with open_store(tmp_path) as s:
        assert put(s, range(8)) == [True] * 8 and len(calls) == 1
        assert s.stats().bytes_reserved == 8 * SLOT     # as much again ahead: 8 slots
        for i in range(8, 64, 8):                     # the range grows: 8, 16, 32 slots ahead
            assert put(s, range(i, i + 8)) == [True] * 8
        assert len(calls) == 3
        assert s.flush() and exact(s, range(64))
        st = s.stats()
        assert st.bytes_reserved == 16 * SLOT          # what is left of the range ...
        assert st.bytes_used == 64 * SLOT              # ... is not reported as stored
    assert index_rows(tmp_path, "reserved") == 0   # close gives the range back
    with open_store(tmp_path) as s:
        assert s.stats().bytes_used == 64 * SLOT and exact(s, range(64))


def test_a_dead_processs_range_is_reclaimed_at_the_next_open(tmp_path):
    p = worker("write", tmp_path, start=0, stop=8, size=SIZE, batch=8, die=True)
    out, _ = p.communicate(timeout=120)
    assert '"ok": [true, true, true, true, true, true, true, true]' in out, out
    assert p.returncode == 0 and index_rows(tmp_path, "reserved") > 0   # died holding its range
    with open_store(tmp_path) as s:
        assert index_rows(tmp_path, "reserved") == 0
        st = s.stats()
        assert st.bytes_used == 8 * SLOT and st.bytes_reserved == 0 and exact(s, range(8))


def test_two_stores_putting_one_key_keep_one_copy(tmp_path):
    with open_store(tmp_path) as a, open_store(tmp_path) as b:
        assert put(a, [0, 1]) == [True, True]
        assert put(b, [1, 2]) == [True, True]          # b does not know of a's block 1 yet
        assert a.flush() and b.flush()
        assert exact(a, [0, 1, 2]) and exact(b, [0, 1, 2])
        assert a.exists_many([key(i) for i in range(3)]) == [True] * 3
        sa = a.stats()
        assert sa.blocks == 3
        assert sa.bytes_used == 3 * SLOT                  # one copy (the ranges reported apart)
    with open_store(tmp_path) as s:
        assert s.stats().bytes_used == 3 * SLOT and exact(s, range(3))


def _take_back_range(d) -> int:
    """Delete every reserved row, as a reclaim that took the owner for dead would."""
    db = sqlite3.connect(d / "index.db", isolation_level=None)
    try:
        return db.execute("DELETE FROM reserved").rowcount
    finally:
        db.close()


def test_a_range_taken_back_in_the_index_is_noticed_by_the_periodic_check(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_write, "PUT_STALE_S", 0.0)      # the check due on every put
    with open_store(tmp_path) as s:
        assert put(s, range(4)) == [True] * 4 and s.flush()
        assert _take_back_range(tmp_path) > 0
        assert put(s, [4]) == [True] and s.flush()             # a slot of a new range
        with open_store(tmp_path) as other:
            assert exact(other, range(5))


def test_a_range_in_a_deleted_slab_is_dropped_before_any_write(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_write, "PUT_STALE_S", 3600.0)   # no periodic check: the fstat one
    with open_store(tmp_path) as s:
        assert put(s, range(4)) == [True] * 4 and s.flush()
        (slab_name,) = [n for n in os.listdir(tmp_path) if n.endswith(".slab")]
        os.unlink(tmp_path / slab_name)
        assert put(s, range(4, 8)) == [True] * 4 and s.flush()  # into a new slab, durable
        with open_store(tmp_path) as other:
            assert exact(other, range(4, 8))
            assert other.exists_many([key(i) for i in range(4)]) == [False] * 4
