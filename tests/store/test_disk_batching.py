"""What a batch of small blocks costs the disk store: a few index statements per batch (not per
block), an unsynced reservation and one synced (group) commit after the slab's fdatasync, small blocks
written and read in large vectored runs, and one fdatasync per touched slab. Real files; the
counts are of calls, never of time."""

from __future__ import annotations

import mmap
import os
import sqlite3

import pytest

from offload.store.disk import writes as disk_write
from offload.store.disk.index.db import Location
from offload.store.disk.slab import coalesce
from offload.store.disk.slab import files as slab
from offload.store.disk.slab import format as slot_format
from tests.store.blocks import data, key
from tests.store.stores import open_store

SIZE = 256 << 10


class _Counting:
    """The index's connection, logging each execute / executemany call (one entry per call)."""

    def __init__(self, db: sqlite3.Connection, log: list[str]):
        self.db, self.log = db, log

    def execute(self, sql: str, *a: object) -> sqlite3.Cursor:
        self.log.append(sql)
        return self.db.execute(sql, *a)

    def executemany(self, sql: str, *a: object) -> sqlite3.Cursor:
        self.log.append(sql)
        return self.db.executemany(sql, *a)

    def __getattr__(self, name: str) -> object:
        return getattr(self.db, name)


def _aligned_blocks(ks: list[bytes], size: int = SIZE) -> tuple[mmap.mmap, list[list[memoryview]]]:
    buf = mmap.mmap(-1, size * len(ks))
    for i, k in enumerate(ks):
        buf[i * size:(i + 1) * size] = data(k, size)
    return buf, [[memoryview(buf)[i * size:(i + 1) * size]] for i in range(len(ks))]


def _put_statements(tmp_path, n: int) -> list[str]:
    with open_store(tmp_path / f"s{n}", 1 << 34) as s:   # a range ahead of 256 MiB
        warm = [key(-1 - i) for i in range(n)]   # the slab exists, and n slots ahead of it
        assert s.put_many(warm, [[data(k, SIZE)] for k in warm]) == [True] * n
        log: list[str] = []
        s._index.db = _Counting(s._index.db, log)  # type: ignore[assignment]
        ks = [key(i) for i in range(n)]
        assert s.put_many(ks, [[data(k, SIZE)] for k in ks]) == [True] * n
        assert s.flush()
        s._index.db = s._index.db.db
    return log


@pytest.mark.parametrize("ranges", [True, False], ids=["from-the-range", "reserving-each-put"])
def test_a_put_costs_the_same_index_statements_for_8_or_64_blocks(tmp_path, monkeypatch, ranges):
    if not ranges:   # no slot reserved ahead: every put runs its own reservation
        monkeypatch.setattr(disk_write, "RANGE_BYTES", 0)
    few, many = _put_statements(tmp_path, 8), _put_statements(tmp_path, 64)
    assert len(many) == len(few), (few, many)
    assert len(many) < 40, many
    assert ("PRAGMA synchronous=NORMAL" in many) is not ranges   # the reservation, if any


def test_the_reservation_is_not_synced_and_the_commit_follows_the_slab_sync(tmp_path, monkeypatch):
    events: list[str] = []
    with open_store(tmp_path) as s:
        s._index.db = _Counting(s._index.db, events)  # type: ignore[assignment]
        real_sync = slab.SlabFiles.sync
        monkeypatch.setattr(slab.SlabFiles, "sync",
                            lambda self, *a: (events.append("slab fdatasync"), real_sync(self, *a))[1])
        ks = [key(i) for i in range(16)]
        assert s.put_many(ks, [[data(k, SIZE)] for k in ks]) == [True] * 16
        assert s.flush()
        s._index.db = s._index.db.db
        assert s._index.db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL again
    marks = [e for e in events if e in ("PRAGMA synchronous=NORMAL", "PRAGMA synchronous=FULL",
                                        "COMMIT", "slab fdatasync")]
    # reserve (unsynced) -> bytes + header written and fdatasync'ed -> one synced commit
    assert marks == ["PRAGMA synchronous=NORMAL", "COMMIT", "PRAGMA synchronous=FULL",
                     "slab fdatasync", "COMMIT"], events


def test_an_unsynced_transaction_restores_full_sync_even_when_it_fails(tmp_path):
    with open_store(tmp_path) as s:
        with pytest.raises(sqlite3.OperationalError):
            with s._index.txn(durable=False):
                s._index.db.execute("SELECT * FROM no_such_table")
        assert s._index.db.execute("PRAGMA synchronous").fetchone()[0] == 2
        assert s.put_many([key(1)], [[data(key(1), SIZE)]]) == [True]


def test_small_blocks_move_in_large_runs_with_one_fdatasync_per_batch(tmp_path, monkeypatch):
    calls: dict[str, list[int]] = {"pwritev": [], "preadv": [], "fdatasync": []}
    wrote: list[int] = []
    real = {name: getattr(os, name) for name in calls}

    def counting(name: str):  # type: ignore[no-untyped-def]
        def call(fd: int, *a: object, **kw: object) -> object:
            if slot_format.parse_segment_name(os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))):
                calls[name].append(len(a[0]) if name != "fdatasync" else 1)  # type: ignore
                if name == "pwritev":
                    wrote.append(sum(memoryview(b).nbytes for b in a[0]))  # type: ignore
            return real[name](fd, *a, **kw)
        return call

    with open_store(tmp_path, io_threads=8) as s:
        ks = [key(i) for i in range(32)]                 # 8 MiB in 256 KiB blocks
        src, blocks = _aligned_blocks(ks)
        for name in calls:
            monkeypatch.setattr(os, name, counting(name))
        assert s.put_many(ks, blocks) == [True] * 32
        assert s.flush()                                  # the committer's one fdatasync
        dst, outs = _aligned_blocks([key(-1)] * 32)
        assert s.get_many(ks, outs) == [True] * 32
        monkeypatch.undo()
        assert dst[:] == src[:]
    runs = 32 * slot_format.slot_bytes_for(SIZE) // coalesce.MIN_RUN_BYTES
    assert len(calls["preadv"]) == runs, calls
    # written in two 4 MiB runs, the first cut into growing pieces (2, 4, 8 blocks, the rest),
    # on several I/O threads (in any order), each call at most WRITE_PIECE_BYTES (a read waits
    # behind one piece, not a run: `slab/gate.py`); a header and the data per block
    assert sum(wrote) == 32 * slot_format.slot_bytes_for(SIZE), wrote
    assert max(wrote) <= slab.WRITE_PIECE_BYTES and sum(calls["pwritev"]) >= 64, calls
    sb = slot_format.slot_bytes_for(SIZE)
    assert len(wrote) == sum(-(-n * sb // slab.WRITE_PIECE_BYTES) for n in (2, 4, 8, 2, 16)), wrote
    assert calls["fdatasync"] == [1]


def test_a_failing_checksum_skips_the_rest_and_leaks_no_slot(tmp_path, monkeypatch):
    """A run that cannot be checksummed (or handed off) is not written: its blocks are skipped,
    the runs written before it are stored, every slot of the batch is accounted for."""
    with open_store(tmp_path, io_threads=4) as s:
        ks = [key(i) for i in range(32)]
        src, blocks = _aligned_blocks(ks)
        last = memoryview(blocks[-1][0])
        real = slot_format.checksum

        def checksum(bufs):  # type: ignore[no-untyped-def]
            if memoryview(bufs[0]) == last:
                raise ValueError("boom")
            return real(bufs)

        monkeypatch.setattr(slot_format, "checksum", checksum)
        ok = s.put_many(ks, blocks)
        monkeypatch.undo()
        assert s.flush() and ok[:16] == [True] * 16 and ok[16:] == [False] * 16  # run 2 not written
        st = s.stats()
        assert st.put_skipped == 16
        assert st.bytes_used == 16 * slot_format.slot_bytes_for(SIZE)
        dst, outs = _aligned_blocks([key(-1)] * 32)
        assert s.get_many(ks, outs) == ok and dst[:SIZE * 16] == src[:SIZE * 16]


def test_the_first_run_is_cut_into_growing_pieces():
    sb = slot_format.slot_bytes_for(SIZE)
    locs = [Location(key(i), 1, i, sb, SIZE, 0) for i in range(40)]
    pieces = coalesce.ramp([list(range(30)), list(range(30, 40))], locs)
    assert [len(p) for p in pieces] == [2, 4, 8, 16, 10]   # ~512 KiB, 1 MiB, 2 MiB, 4 MiB, ...
    assert sum(pieces, []) == list(range(40))              # same blocks, same order
    assert coalesce.ramp([[0]], locs) == [[0]] and coalesce.ramp([], locs) == []


def test_run_k_is_written_while_run_k_plus_1_is_checksummed(tmp_path, monkeypatch):
    """Pipelined: the last block's checksum is computed only after a write has started (a
    batch checksummed whole before its first write would wait here, then fail)."""
    wrote = __import__("threading").Event()
    real_csum, real_pwritev = slot_format.checksum, os.pwritev
    waited: list[bool] = []

    def pwritev(fd, iov, off):  # type: ignore[no-untyped-def]
        wrote.set()
        return real_pwritev(fd, iov, off)

    with open_store(tmp_path, io_threads=1) as s:   # one I/O thread: no overlap but the pipeline
        ks = [key(i) for i in range(32)]
        src, blocks = _aligned_blocks(ks)
        last = memoryview(blocks[-1][0])

        def checksum(bufs):  # type: ignore[no-untyped-def]
            if memoryview(bufs[0]) == last:
                waited.append(wrote.wait(10))
            return real_csum(bufs)

        monkeypatch.setattr(slot_format, "checksum", checksum)
        monkeypatch.setattr(os, "pwritev", pwritev)
        assert s.put_many(ks, blocks) == [True] * 32 and s.flush()
        monkeypatch.undo()
        assert waited == [True]
        dst, outs = _aligned_blocks([key(-1)] * 32)
        assert s.get_many(ks, outs) == [True] * 32 and dst[:] == src[:]


def test_plan_keeps_threads_busy_without_cutting_runs_below_the_minimum():
    def locs(n: int, size: int) -> list[Location]:
        sb = slot_format.slot_bytes_for(size)
        return [Location(key(i), 1, i, sb, size, 0) for i in range(n)]

    buf = mmap.mmap(-1, 16 << 20)

    def bufs(n: int, size: int) -> list[list[memoryview]]:
        return [[memoryview(buf)[:size]] for _ in range(n)]

    small = coalesce.plan_runs(locs(32, SIZE), bufs(32, SIZE), threads=8)
    assert [len(r) for r in small] == [16, 16]                     # 8 MiB: two 4 MiB runs
    mid = coalesce.plan_runs(locs(32, 1 << 20), bufs(32, 1 << 20), threads=8)
    assert [len(r) for r in mid] == [4] * 8                        # 32 MiB: every thread busy
    one = coalesce.plan_runs(locs(4, SIZE), bufs(4, SIZE), threads=8)
    assert [len(r) for r in one] == [4]                            # 1 MiB: one call
    big = coalesce.plan_runs(locs(4, 16 << 20), bufs(4, 16 << 20), threads=8)
    assert [len(r) for r in big] == [1] * 4                        # never above RUN_BYTES
