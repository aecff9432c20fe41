"""A writer is alive while the kernel holds its lock, whatever happens to the files that name it
(issue 36, item 3). An age-based cleaner (`find DIR -mtime +N -delete`, systemd-tmpfiles) or an
operator's `rm lease-*` deletes a live writer's lease file and the directory's lock file; then
other processes open the directory (a second writer, `cache stats`, `cache verify`): none of the
live writer's reserved slots is reclaimed, none of its flushed blocks is lost, and `cache stats`
on a damaged index refuses to rebuild it beside the writer. Real processes, real files."""

from __future__ import annotations

import glob
import os
import sqlite3
import subprocess
import sys
import time

import pytest

from tests.store.blocks import key
from tests.store.sharers import ENV, SIZE, cache_stats, durable_blocks, line, lost, proc
from tests.store.sharers import damage_a_page_nobody_writes as damage_the_index
from tests.store.stores import open_store

pytestmark = pytest.mark.slow

OLD = time.time() - 30 * 86400   # a month ago: what an age-based cleaner deletes


def _clean_like_find(d) -> list[str]:
    """What `find DIR -mtime +7 -name 'lease-*' -delete` (and the lock file with it) does to a
    cache directory whose lease and lock files were never touched after creation."""
    names = [n for n in os.listdir(d) if n.startswith("lease-") or n == "lock"]
    for n in names:
        os.utime(os.path.join(d, n), (OLD, OLD))
    r = subprocess.run(["find", str(d), "-maxdepth", "1", "-mtime", "+7", "(", "-name", "lease-*",
                        "-o", "-name", "lock", ")", "-delete"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert not any(n.startswith("lease-") for n in os.listdir(d))
    return names


def _reserved(d) -> dict[str, int]:
    db = sqlite3.connect(f"file:{d}/index.db?mode=ro", uri=True)
    try:
        return dict(db.execute("SELECT owner, count(*) FROM reserved GROUP BY owner").fetchall())
    finally:
        db.close()


def test_a_deleted_lease_file_never_makes_a_live_writer_dead(tmp_path):
    d = tmp_path / "cache"
    with open_store(d):
        pass
    stop = tmp_path / "stop"
    sizes = [SIZE, 2 * SIZE, 3 * SIZE, 5 * SIZE]
    idle = proc("sizes", d, first=10_000, sizes=sizes, stop=str(stop))
    w = None
    try:
        first = line(idle)
        assert first["flushed"] and all(first["ok"])
        held = _reserved(d)   # the idle writer's range ahead (it writes nothing more)
        assert len(held) == 1 and sum(held.values()) >= len(sizes), held
        w = proc("stream", d, start=0, batch=8, stop=str(stop), size=SIZE)
        for _ in range(4):
            assert line(w)["flushed"]
        _clean_like_find(d)
        # other processes open the directory: a writer, `cache stats`, `cache verify`, a store
        other = proc("stream", d, start=50_000, batch=4, stop_after=50_016, size=SIZE)
        assert all(line(other)["flushed"] for _ in range(4))
        assert other.wait(120) == 0
        for cmd in ("stats", "verify"):
            r = subprocess.run([sys.executable, "-m", "offload.cli", "cache", cmd, str(d)],
                               capture_output=True, text=True, env=ENV, timeout=300)
            assert r.returncode == 0, r.stderr
        with open_store(d):
            pass
        after = _reserved(d)
        assert {o: after.get(o, 0) for o in held} == held   # not one slot reclaimed
        stop.touch()
        acked = durable_blocks(w)
        assert idle.wait(120) == 0 and w.wait(120) == 0
    finally:
        stop.touch()
        for p in (idle, w):
            if p is not None and p.poll() is None:
                p.kill()
    assert len(acked) >= 32
    assert lost(d, acked) == []
    with open_store(d) as s:   # the idle writer's blocks too
        assert all(s.exists_many([key(10_000 + i) for i in range(len(sizes))]))


def test_cache_stats_does_not_rebuild_beside_a_writer_whose_lease_file_was_deleted(tmp_path):
    d = tmp_path / "cache"
    with open_store(d):
        pass
    stop = tmp_path / "stop"
    w = proc("stream", d, start=0, batch=8, stop=str(stop), size=SIZE)
    try:
        for _ in range(5):
            assert line(w)["flushed"]
        _clean_like_find(d)
        damage_the_index(d)
        st = cache_stats(d)
        aside_while_alive = glob.glob(str(d / "index.db.damaged-*"))
        time.sleep(1.0)   # the writer goes on putting meanwhile
        stop.touch()
        acked = durable_blocks(w)
        assert w.wait(120) == 0
    finally:
        stop.touch()
        if w.poll() is None:
            w.kill()
    assert st.returncode != 0 and "other process" in st.stderr, st.stderr
    assert aside_while_alive == []
    assert len(acked) > 40
    assert lost(d, acked) == []   # the first open alone rebuilds it
