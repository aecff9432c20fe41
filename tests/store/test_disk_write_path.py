"""The disk store's write path: group commit off the caller's path, a data path that never waits on
another process's index transaction, and slots given back by a failed commit. Real files, a real
second process holding SQLite's write lock, a real full file system; counts and ordering, never
wall-clock figures."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading

import pytest

from offload.store.base import Backlog, durable
from offload.store.disk import recovery
from offload.store.disk import writes as disk_write
from offload.store.disk.index.db import Index
from tests.store.blocks import data, key
from tests.store.stores import open_store, small_tmpfs, worker
from tests.store.writes import SIZE, exact, put

HOLDER = """
import select, sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
print("held", flush=True)
select.select([sys.stdin], [], [], 60)   # until told, or a minute: then the transaction ends
db.execute("COMMIT")
"""


def hold_write_transaction(index_path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(index_path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def release(p: subprocess.Popen) -> None:
    assert p.stdin is not None
    p.stdin.write("\n")
    p.stdin.close()
    p.wait(timeout=60)


class Gate:
    """Holds the group committer before its fdatasync until opened."""

    def __init__(self, store) -> None:  # type: ignore[no-untyped-def]
        self.open, self.reached = threading.Event(), threading.Event()
        real = store._commits._sync

        def sync(segs):  # type: ignore[no-untyped-def]
            self.reached.set()
            self.open.wait(60)
            return real(segs)

        store._commits._sync = sync


# ---- the data path vs a busy index -------------------------------------------------------------

def test_a_put_waits_out_a_slow_index_commit_of_its_own_process(tmp_path):
    """The write lock held past the read path's deadline (a log sync on a loaded disk): a put
    that needs a reservation waits for it (`PUT_WAIT_S`) instead of skipping its blocks."""
    from offload.store.disk.index.access import DATA_LOCK_TIMEOUT_S
    assert disk_write.PUT_WAIT_S > 2 * DATA_LOCK_TIMEOUT_S
    with open_store(tmp_path) as s:
        assert put(s, [0]) == [True] and s.flush()
        lock = s._state.ix.wlock
        assert lock.acquire(timeout=5)
        got: list[list[bool]] = []
        t = threading.Thread(target=lambda: got.append(put(s, [1], 2 * SIZE)))  # a new size
        t.start()
        t.join(1.5 * DATA_LOCK_TIMEOUT_S)    # past the read path's deadline, within the put's
        lock.release()
        t.join(60)
        assert got == [[True]] and s.flush() and exact(s, [1], 2 * SIZE)
        assert s.stats().put_skipped == 0


def test_a_promotion_waits_for_the_index_only_as_long_as_a_read(tmp_path):
    """`promote_many` runs on a get's path (a shared tier's block copied to the local disk): with
    the write lock held past the read path's deadline it skips its block, counted, where a put
    (test above) would have waited; the block is stored by the next promotion."""
    from offload.store.disk.index.access import DATA_LOCK_TIMEOUT_S
    with open_store(tmp_path) as s:
        assert put(s, [0]) == [True] and s.flush()
        lock = s._state.ix.wlock
        assert lock.acquire(timeout=5)
        release_at = threading.Timer(2 * DATA_LOCK_TIMEOUT_S, lock.release)
        release_at.start()
        try:
            ks = [key(1)]
            assert s.promote_many(ks, [[data(ks[0], 2 * SIZE)]]) == [False]   # a new size
        finally:
            release_at.join(60)
        assert s.stats().put_skipped == 1
        ks = [key(1)]
        assert s.promote_many(ks, [[data(ks[0], 2 * SIZE)]]) == [True]
        assert s.flush() and exact(s, [1], 2 * SIZE)


def test_a_held_write_transaction_elsewhere_never_stalls_the_data_path(tmp_path):
    with open_store(tmp_path) as s:
        assert put(s, [0, 1]) == [True, True] and s.flush()
        holder = hold_write_transaction(tmp_path / "index.db")
        try:
            assert put(s, [6]) == [True]                   # a slot of the reserved range
            assert put(s, [5], 2 * SIZE) == [False]        # a new size needs the index: skipped
            assert exact(s, [0])                           # reads go on
            assert s.exists_many([key(0), key(5), key(6)]) == [True, False, True]
            assert s.delete_many([key(1)]) == 0            # a busy index: nothing deleted
            assert holder.poll() is None                   # all returned before it ended
            st = s.stats()
            assert st.index_busy >= 2 and st.put_skipped == 1
        finally:
            release(holder)
        assert put(s, [5], 2 * SIZE) == [True] and s.flush() and exact(s, [5], 2 * SIZE)
        assert exact(s, [6]) and s.delete_many([key(1)]) == 1


def test_reads_go_on_while_a_put_of_this_process_waits_for_the_index(tmp_path, monkeypatch):
    with open_store(tmp_path) as s:
        assert put(s, [0]) == [True] and s.flush()
        inside, go = threading.Event(), threading.Event()
        real = Index.reserve

        def waiting(self, *a, **kw):  # type: ignore[no-untyped-def]
            inside.set()
            go.wait(20)
            return real(self, *a, **kw)

        monkeypatch.setattr(Index, "reserve", waiting)
        t = threading.Thread(target=put, args=(s, [1], 2 * SIZE))   # a size with no range yet
        t.start()
        try:
            assert inside.wait(60)
            assert exact(s, [0]) and s.exists_many([key(0)]) == [True]
            assert t.is_alive()                            # read while the put still waited
        finally:
            go.set()
            t.join(60)


# ---- group commit ----------------------------------------------------------------------------

def test_put_returns_once_written_and_the_block_is_visible_once_durable(tmp_path):
    with open_store(tmp_path) as s, open_store(tmp_path) as other:
        gate = Gate(s)
        src = [bytearray(data(key(i), SIZE)) for i in range(4)]
        ks = [key(i) for i in range(4)]
        assert s.put_many(ks, [[b] for b in src]) == [True] * 4
        assert gate.reached.wait(60)                       # put returned before any fdatasync
        for b in src:                                      # the caller's buffers are free again
            b[:] = bytes(SIZE)
        assert other.exists_many(ks) == [False] * 4        # not durable: invisible elsewhere
        assert s.exists_many(ks) == [True] * 4             # in flight: stored, for this process
        used = s._state.ix.reader.usage()[1]
        assert put(s, range(4)) == [True] * 4              # not written twice
        assert s._state.ix.reader.usage()[1] == used
        gate.open.set()
        assert durable(s, ks, [True, True, True, False]) == [True, True, True, False]
        assert s.flush()
        assert other.exists_many(ks) == [True] * 4 and exact(other, range(4))
        assert s.stats().puts == 4


def test_rounds_are_grouped_and_a_waiter_starts_one_at_once(tmp_path):
    with open_store(tmp_path) as s, open_store(tmp_path) as other:
        syncs: list[object] = []
        real = s._commits._sync
        s._commits._sync = lambda segs: (syncs.append(segs), real(segs))[1]
        s._commits._group_s = 3600.0                       # no round starts on its own
        assert put(s, [0]) == [True] and put(s, [1]) == [True]
        assert other.exists_many([key(0), key(1)]) == [False, False] and not syncs
        assert s.flush(timeout=60)                         # a waiter: the round starts now
        assert len(syncs) == 1                             # both puts in one round
        assert other.exists_many([key(0), key(1)]) == [True, True]
        assert put(s, [2]) == [True]
        assert exact(s, [2]) and len(syncs) == 2           # a get hurries its block's round
        assert put(s, [3]) == [True]
        assert durable(s, [key(3)], [True]) == [True] and len(syncs) == 3   # so does `durable`


def test_a_waiter_that_does_not_hurry_leaves_rounds_grouped_and_a_kick_starts_one(tmp_path):
    with open_store(tmp_path) as s:
        s._commits._group_s = 3600.0
        assert put(s, [0]) == [True]
        assert s._commits.wait_for([key(0)], 0.05, hurry=False) is False   # still in flight
        assert s._commits.backlog() == Backlog(1, SIZE)     # written, not yet durable
        s.commit_now()                                     # without waiting for it
        assert s._commits.wait_for([key(0)], 60, hurry=False) is True
        assert s._commits.backlog() == Backlog(0, 0)
        assert s.durable([key(0)], hurry=False) == [True]


def test_a_round_starts_on_its_own_once_enough_is_pending(tmp_path):
    with open_store(tmp_path) as s, open_store(tmp_path) as other:
        s._commits._group_s, s._commits._group_bytes = 3600.0, 2 * SIZE
        assert put(s, [0, 1]) == [True, True]
        for _ in range(6000):                              # nobody waits on `s`: no hurry
            if other.exists_many([key(0), key(1)]) == [True, True]:
                break
            threading.Event().wait(0.01)
        assert other.exists_many([key(0), key(1)]) == [True, True]


def test_a_round_starts_on_its_own_once_its_first_batch_waited_long_enough(tmp_path):
    with open_store(tmp_path) as s, open_store(tmp_path) as other:
        s._commits._group_s, s._commits._group_bytes = 0.05, 1 << 40
        assert put(s, [0]) == [True]
        for _ in range(6000):                              # nobody waits on `s`: no hurry
            if other.exists_many([key(0)]) == [True]:
                break
            threading.Event().wait(0.01)
        assert other.exists_many([key(0)]) == [True]


def test_a_put_sees_this_process_evictions_at_once(tmp_path, monkeypatch):
    """A put trusts its key set for a while (PUT_STALE_S), but not past its own evictions: a key
    it just evicted is stored again, not skipped as stored."""
    monkeypatch.setattr(disk_write, "PUT_STALE_S", 3600.0)
    with open_store(tmp_path, capacity=4 << 20) as s, open_store(tmp_path, capacity=4 << 20) as other:
        i = 0
        while s.stats().evictions == 0 and i < 500:
            assert put(s, [i]) == [True] and s.flush()
            i += 1
        gone = [j for j in range(i) if other.exists_many([key(j)]) == [False]]
        assert gone and s.stats().evictions > 0
        assert put(s, [gone[0]]) == [True] and s.flush()
        assert other.exists_many([key(gone[0])]) == [True] and exact(s, [gone[0]])


def test_a_put_right_after_another_process_rebuilt_the_index_lands_in_the_new_one(
        tmp_path, monkeypatch):
    monkeypatch.setattr(disk_write, "PUT_STALE_S", 3600.0)
    with open_store(tmp_path) as s:
        assert put(s, [0, 1]) == [True, True] and s.flush()
        for name in os.listdir(tmp_path):                  # as a rebuild sets it aside
            if name.startswith("index.db"):
                os.rename(tmp_path / name, tmp_path / f"aside-{name}")
        with monkeypatch.context() as m:   # as a version that rebuilt beside live writers did
            m.setattr(recovery, "live_leases", lambda d, mine=None: [])
            with open_store(tmp_path) as b:                # rebuilds from the slab headers
                assert b.exists_many([key(0), key(1)]) == [True, True]
        assert put(s, [2]) == [True] and s.flush()         # noticed at once: a new range, committed
        with open_store(tmp_path) as c:
            assert c.exists_many([key(0), key(1), key(2)]) == [True] * 3 and exact(c, [2])


def test_a_get_of_a_block_in_flight_waits_for_its_commit(tmp_path):
    with open_store(tmp_path) as s:
        gate = Gate(s)
        assert put(s, [0]) == [True]
        assert gate.reached.wait(60)
        got: list[bool] = []
        t = threading.Thread(target=lambda: got.append(exact(s, [0])))
        t.start()
        gate.open.set()
        t.join(60)
        assert got == [True]


def test_a_block_deleted_while_in_flight_never_appears(tmp_path):
    with open_store(tmp_path) as s, open_store(tmp_path) as other:
        gate = Gate(s)
        assert put(s, [0, 1]) == [True, True]
        assert gate.reached.wait(60)
        out: list[int] = []
        t = threading.Thread(target=lambda: out.append(s.delete_many([key(0)])))
        t.start()
        while key(0) not in s._commits._cancelled and t.is_alive():
            threading.Event().wait(0.001)
        gate.open.set()                                    # the round drops it: never committed
        t.join(60)
        assert out == [1] and s.flush()
        assert s.exists_many([key(0), key(1)]) == [False, True]
        assert other.exists_many([key(0), key(1)]) == [False, True]
        st = s.stats()
        assert st.bytes_used == SIZE + 4096   # its slot given back


def test_pending_work_is_bounded(tmp_path):
    with open_store(tmp_path, pending_bytes=SIZE) as s:
        gate = Gate(s)
        assert put(s, [0]) == [True]
        assert gate.reached.wait(60)
        assert put(s, [1]) == [False]                      # no room within the deadline: skipped
        gate.open.set()
        assert s.flush() and put(s, [1]) == [True] and s.flush() and exact(s, [0, 1])


def test_close_flushes(tmp_path):
    with open_store(tmp_path) as s:
        assert put(s, range(8)) == [True] * 8
    with open_store(tmp_path) as s:
        assert exact(s, range(8))


def test_the_first_put_imports_no_numpy(tmp_path):
    code = f"""
import mmap, sys
sys.path.insert(0, {os.getcwd()!r})
from tests.store.stores import open_store
with open_store({str(tmp_path)!r}) as s:
    m = mmap.mmap(-1, 4 << 20)
    assert s.put_many([bytes(range(32))], [[memoryview(m)]]) == [True]
    assert s.get_many([bytes(range(32))], [[memoryview(m)]]) == [True]
print("numpy" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


# ---- a failed commit -------------------------------------------------------------------------

@pytest.mark.parametrize("release_fails", [False, True])
def test_a_failed_commit_frees_its_slots_and_its_keys(tmp_path, monkeypatch, release_fails):
    fail = ["commit"] + (["release"] if release_fails else [])
    real_finish, real_release = Index.commit_reserved, Index.return_reserved

    def finish(self, *a, **kw):  # type: ignore[no-untyped-def]
        if "commit" in fail:
            fail.remove("commit")
            raise sqlite3.OperationalError("database or disk is full")
        return real_finish(self, *a, **kw)

    def release_(self, *a, **kw):  # type: ignore[no-untyped-def]
        if "release" in fail:
            fail.remove("release")
            raise sqlite3.OperationalError("database or disk is full")
        return real_release(self, *a, **kw)

    monkeypatch.setattr(Index, "commit_reserved", finish)
    monkeypatch.setattr(Index, "return_reserved", release_)
    with open_store(tmp_path) as s:
        ok = put(s, range(8))
        assert durable(s, [key(i) for i in range(8)], ok) == [False] * 8    # not acknowledged
        s.stats()                                     # a metrics scrape does not hide the loss
        assert not s.flush()
        assert s.exists_many([key(i) for i in range(8)]) == [False] * 8  # never appears
        assert s.stats().put_skipped == 8                                 # counted
        if release_fails:   # given back by this process's next index transaction
            assert put(s, [8]) == [True] and s.flush()
        st = s.stats()     # reserved slots not written (this process's range) are counted apart
        assert st.bytes_used == release_fails * (SIZE + 4096)   # none leaked
        # at once storable by any process
        p = worker("write", tmp_path, start=0, stop=8, size=SIZE, batch=8)
        out, _ = p.communicate(timeout=120)
        assert '"ok": [true, true, true, true, true, true, true, true]' in out, out
        assert s.exists_many([key(i) for i in range(8)]) == [True] * 8 and exact(s, range(8))


def test_disk_full_at_the_index_commit_frees_the_slots(tmp_path):
    with small_tmpfs(tmp_path / "small", "4m") as mnt:
        with open_store(mnt / "cache", free_bytes=lambda _p: 1 << 40) as s:
            gate = Gate(s)
            assert put(s, range(4)) == [True] * 4
            assert gate.reached.wait(60)
            filler = mnt / "filler"
            with open(filler, "wb") as f:   # the file system fills up before the commit
                chunk = bytes(64 << 10)
                try:
                    while True:
                        f.write(chunk)
                        f.flush()
                except OSError:
                    pass
            gate.open.set()
            assert not s.flush()                           # lost: the commit failed
            assert s.exists_many([key(i) for i in range(4)]) == [False] * 4
            assert s.stats().put_skipped >= 4
            os.unlink(filler)
            assert put(s, range(4)) == [True] * 4 and s.flush() and exact(s, range(4))
            st = s.stats()
            assert st.bytes_used == 4 * (SIZE + 4096)
