"""A block is called bad -- and deleted -- only after a re-read under the write lock, by every
reader: the data path (`get`), `cache verify` and a rebuild (issue 36, item 10).

Per path, deterministically: the first read of a block meets bad bytes on disk (a slot rewritten
under it), the bytes are good again by the time the reader holds the write lock: the block stays,
and nothing is counted as corruption; bytes still bad at the re-read are deleted and counted.
Then the race on real processes: writers rewriting their slots (delete and put again, so slots
change hands) and writers SIGKILLed mid-batch while `cache verify` runs, in this process and as
the `sglang-offload cache verify` command: no verify ever reports (or deletes) a bad block, and
every block a writer was told is durable reads back."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from offload.store.base import get_bytes
from offload.store.disk import recovery
from offload.store.disk.slab import format as slot_format
from tests.store.blocks import data, key
from tests.store.sharers import ENV, durable_blocks, line, lost, proc
from tests.store.stores import open_store

pytestmark = pytest.mark.slow

SIZE = 64 << 10
CAP = 16 << 30   # no eviction in the race below: every block missing would be a loss


def _flip(d: Path, store, k: bytes) -> tuple[str, int, bytes]:
    """Flip one data byte of `k`'s slot on disk; returns what restores it."""
    loc = store._state.ix.reader.locate([k])[k]
    path = store._state.slabs.path(loc.seg, loc.slot_bytes)
    off = loc.slot * loc.slot_bytes + slot_format.HEADER_BYTES + 100
    with open(path, "r+b") as f:
        f.seek(off)
        was = f.read(1)
        f.seek(off)
        f.write(bytes([was[0] ^ 0xFF]))
        os.fsync(f.fileno())
    return path, off, was


def _restore(path: str, off: int, was: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(was)
        os.fsync(f.fileno())


def _good_again_at_the_re_read(store, undo) -> None:
    """The slot is rewritten good between a reader's first read and its re-read under the lock
    (what a writer rewriting the slot does to a reader racing it)."""
    st = store._state
    real = st.still_bad

    def still_bad(loc):
        _restore(*undo)
        return real(loc)

    st.still_bad = still_bad


def test_every_reader_keeps_a_block_that_is_good_on_the_re_read(tmp_path):
    d = tmp_path / "cache"
    with open_store(d) as s:
        ks = [key(i) for i in range(4)]
        assert all(s.put_many(ks, [[data(k, SIZE)] for k in ks])) and s.flush()
        # the data path
        _good_again_at_the_re_read(s, _flip(d, s, ks[0]))
        assert get_bytes(s, ks[0], SIZE) is None          # this read missed...
        assert s.exists_many([ks[0]]) == [True]             # ...the block stays
        assert get_bytes(s, ks[0], SIZE) == data(ks[0], SIZE)
        assert s.stats().checksum_failures == 0 and s.stats().reused_reads == 1
        # cache verify
        _good_again_at_the_re_read(s, _flip(d, s, ks[1]))
        assert s.verify() == (4, [])
        assert get_bytes(s, ks[1], SIZE) == data(ks[1], SIZE)
        assert s.stats().checksum_failures == 0
        # and bytes still bad under the lock are bad: deleted, counted (both paths)
        del s._state.still_bad
        _flip(d, s, ks[2])
        _flip(d, s, ks[3])
        assert get_bytes(s, ks[2], SIZE) is None and s.exists_many([ks[2]]) == [False]
        checked, bad = s.verify()
        assert checked == 3 and [k for k, _ in bad] == [ks[3]]
        assert s.stats().checksum_failures == 2


def test_a_rebuild_frees_a_slot_only_if_its_header_is_bad_on_a_re_read(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    with open_store(d) as s:
        ks = [key(i) for i in range(3)]
        assert all(s.put_many(ks, [[data(k, SIZE)] for k in ks])) and s.flush()
        loc = s._state.ix.reader.locate([ks[1]])[ks[1]]
    for name in os.listdir(d):
        if name.startswith("index.db"):
            os.unlink(d / name)             # a rebuild from the slab headers
    reads: dict[int, int] = {}
    real = recovery.slab.SlabFiles.read_header

    def first_read_fails(self, seg, sb, slot, errors=False):   # a slot read mid-rewrite
        reads[slot] = reads.get(slot, 0) + 1
        if slot == loc.slot and reads[slot] == 1:
            return None
        return real(self, seg, sb, slot, errors)

    monkeypatch.setattr(recovery.slab.SlabFiles, "read_header", first_read_fails)
    with open_store(d) as s:
        assert reads[loc.slot] == 2
        for k in ks:
            assert get_bytes(s, k, SIZE) == data(k, SIZE)


def _deleted(d, ids: list[int]) -> int:
    """How many of `ids` the change log records as deleted or evicted (for a failure's message)."""
    db = sqlite3.connect(f"file:{d}/index.db?mode=ro", uri=True)
    try:
        gone = {bytes(k) for (k,) in db.execute("SELECT key FROM changes WHERE op=2")}
    finally:
        db.close()
    return sum(key(i) in gone for i in ids)


def _verify_cli(d) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "offload.cli", "cache", "verify", str(d)],
                          capture_output=True, text=True, env=ENV, timeout=300)


def test_verify_beside_rewriting_and_killed_writers_never_deletes_a_good_block(tmp_path):
    d = tmp_path / "cache"
    with open_store(d, CAP):
        pass
    stop = tmp_path / "stop"
    churn = None
    steady = proc("stream", d, start=1000, batch=2, stop=str(stop), size=SIZE, capacity=CAP)
    reports = []
    try:
        assert line(steady)["flushed"]
        for rnd in range(12):
            churn = proc("churn", d, n=24, seconds=3, size=SIZE, capacity=CAP)   # slots move
            first = 100_000 + 1000 * rnd
            killed = proc("stream", d, start=first, batch=4, stop=str(stop), size=SIZE,
                          stop_after=first + 400, capacity=CAP)
            assert line(killed)["flushed"]
            with open_store(d, CAP) as s:
                reports.append(s.verify()[1])
            if rnd % 3 == 0:
                r = _verify_cli(d)
                assert r.returncode == 0, r.stderr
                reports.append(r.stdout.strip())
            killed.send_signal(signal.SIGKILL)
            killed.wait(60)
            assert churn.wait(120) == 0
        stop.touch()
        acked = durable_blocks(steady)
        assert steady.wait(120) == 0
    finally:
        stop.touch()
        for p in (churn, steady):
            if p is not None and p.poll() is None:
                p.kill()
    assert all(r == [] or (isinstance(r, str) and " 0 bad" in r) for r in reports), reports
    assert _deleted(d, acked) == 0   # none evicted or deleted: each must read back
    missing = lost(d, acked)
    assert missing == [], (len(missing), len(acked), missing[:10], _deleted(d, missing))
    with open_store(d, CAP) as s:
        assert s.verify()[1] == [] and s.stats().checksum_failures == 0
        for i in range(24):   # the churned blocks: each stored or not, never wrong
            got = get_bytes(s, key(i), SIZE)
            assert got is None or got == data(key(i), SIZE)
