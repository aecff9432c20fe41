"""Cleanup that cannot lose a good block: hostile index rows are a miss for that block only and
are dropped (for `get` and `cache verify`, which never allocates from them); a corrupt read drops
only the exact row it read (not a block put again into the same slot meanwhile, also across two
processes); a freed slot whose hole punch failed (EMFILE) stays a tombstone, so a rebuild does not
bring its block back. Real files, real processes, a real file-descriptor limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from offload.store.disk.slab import format as slot_format
from tests.store.blocks import data, key
from tests.store.rows import HOSTILE, SIZE, edit_rows, exact, put
from tests.store.stores import damage_index as damage
from tests.store.stores import index_rows, open_store

SLOT = slot_format.slot_bytes_for(SIZE)
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_hostile_rows_are_a_miss_for_that_block_only_and_dropped(tmp_path):
    d = tmp_path / "cache"
    with open_store(d) as s:
        assert put(s, range(8)) == [True] * 8
    edit_rows(d, HOSTILE)
    with open_store(d) as s:
        ks = [key(i) for i in range(8)]
        bufs = [bytearray(SIZE) for _ in ks]
        got = s.get_many(ks, [[b] for b in bufs])   # one batch: the good blocks still hit
        assert got == [i not in HOSTILE for i in range(8)]
        assert all(bytes(b) == data(k, SIZE) for b, k, ok in zip(bufs, ks, got) if ok)
        assert s.exists_many(ks) == got
        assert 0 <= s.stats().bytes_used <= 8 * SLOT
    assert index_rows(d) == 8 - len(HOSTILE)   # each bad row dropped, the good ones kept


def test_verify_never_allocates_from_or_crashes_on_hostile_rows(tmp_path):
    d = tmp_path / "cache"
    with open_store(d) as s:
        assert put(s, range(8)) == [True] * 8
    edit_rows(d, {**HOSTILE, 7: ("slot", 1000)})      # 7: a slot past the end of its slab
    with open_store(d) as s:
        checked, bad = s.verify()
        assert checked == 2 and [k for k, _ in bad] == [key(7)]
    assert index_rows(d) == 1
    with open_store(d) as s:                          # and again: nothing left to crash on
        assert s.verify() == (1, [])
    with open_store(d) as s:
        assert exact(s, [0]) == [True]


def test_a_corrupt_read_never_drops_the_block_put_again_into_its_slot(tmp_path):
    """The race of issue 21 made deterministic: a reader's stale location of a block that was
    deleted and put again into the same slot is cleaned up as corrupt."""
    d = tmp_path / "cache"
    cap = 8 * SLOT          # too small to reserve slots ahead: the freed slot is the next one taken
    with open_store(d, cap) as a, open_store(d, cap) as b:
        assert put(a, range(3)) == [True] * 3
        stale = b._index.locate([key(1)])[key(1)]
        assert a.delete_many([key(1)]) == 1
        assert put(a, [1]) == [True]
        fresh = a._index.locate([key(1)])[key(1)]
        assert (fresh.seg, fresh.slot) == (stale.seg, stale.slot)   # the same slot, reused
        st = b._state
        assert st.ix.write(lambda ix: st.drop_bad(ix, [stale])) == []   # not the row that was read
        assert exact(a, range(3)) == [True] * 3 and exact(b, [1]) == [True]


READER = """
import os, sys
sys.path.insert(0, sys.argv[2])
from offload.store.base import get_bytes
from tests.store.blocks import key
from tests.store.stores import open_store
with open_store(sys.argv[1]) as s:
    print("ready", flush=True)
    while not os.path.exists(sys.argv[4]):
        get_bytes(s, key(0), int(sys.argv[3]))
"""


def test_reput_race_under_two_processes_loses_no_acknowledged_block(tmp_path):
    """One process deletes and puts a block again in a loop; another reads it all along (its
    failed reads clean up as corrupt). No acknowledged put may be deleted by that cleanup."""
    d, stop = tmp_path / "cache", tmp_path / "stop"
    with open_store(d) as s:
        assert put(s, [0]) == [True]
        p = subprocess.Popen([sys.executable, "-c", READER, str(d), ROOT, str(SIZE), str(stop)],
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout and p.stdout.readline().strip() == "ready"
        lost = 0
        try:
            for _ in range(400):
                lost += s.delete_many([key(0)]) == 0   # 0: our acknowledged put was dropped
                assert put(s, [0]) == [True]
        finally:
            stop.touch()
            p.wait(60)
        assert lost == 0
        assert exact(s, [0]) == [True]


EMFILE = """
import json, os, resource, sys
sys.path.insert(0, sys.argv[2])
from tests.store.rows import put
from tests.store.stores import open_store
from tests.store.blocks import key
slot = int(sys.argv[3])
with open_store(sys.argv[1], segment_size=slot) as s:       # a slab per block
    assert put(s, range(12)) == [True] * 12
with open_store(sys.argv[1], segment_size=slot, max_open_slabs=2) as s:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    fill = []
    try:
        while True:
            fill.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    n = s.clear()                                       # every hole punch fails: EMFILE
    for fd in fill:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    tomb = getattr(s._index, "tombstoned", lambda: [])()
    assert put(s, range(100, 104)) == [True] * 4        # never into a tombstoned slot
print(json.dumps({"cleared": n, "tombstones": len(tomb)}), flush=True)
"""


def test_failed_hole_punch_under_emfile_never_resurrects_a_deleted_block(tmp_path):
    d = tmp_path / "cache"
    r = subprocess.run([sys.executable, "-c", EMFILE, str(d), ROOT, str(SLOT)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["cleared"] == 12
    with open_store(d, segment_size=SLOT) as s:          # the tombstones are punched again here
        assert s._index.tombstoned() == []
        assert exact(s, range(100, 104)) == [True] * 4
    damage(d)                                            # then the index is lost: rebuilt
    with open_store(d, segment_size=SLOT) as s:
        assert s.rebuilt_from
        assert s.exists_many([key(i) for i in range(12)]) == [False] * 12
        assert exact(s, range(100, 104)) == [True] * 4
