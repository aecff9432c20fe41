"""One cache directory, many processes, as an operator and a container runtime use it: a rebuild
by `cache stats` beside a live writer, a writer in another PID namespace (`unshare --pid`, as a
container sharing the host's directory), a writer paused holding SQLite's write lock. Real
processes, real files; whatever a writer was told is durable reads back byte-exact afterwards."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from offload.errors import StoreError
from tests.store.sharers import (
    ROOT,
    SIZE,
    cache_stats,
    damage_a_page_nobody_writes,
    durable_blocks,
    line,
    lost,
    proc,
)
from tests.store.stores import open_store

pytestmark = pytest.mark.slow


def test_cache_stats_finding_a_damaged_index_beside_a_live_writer_loses_nothing(tmp_path):
    d = tmp_path / "cache"
    with open_store(d):
        pass
    w = proc("stream", d, start=0, batch=8, stop=str(tmp_path / "stop"), size=SIZE)
    try:
        for _ in range(5):
            assert line(w)["flushed"]
        damage_a_page_nobody_writes(d)
        st = cache_stats(d)   # the operator's look, documented as safe while serving
        time.sleep(1.0)       # the writer goes on putting meanwhile
        (tmp_path / "stop").touch()
        acked = durable_blocks(w)
        assert w.wait(120) == 0
    finally:
        w.kill()
    assert len(acked) > 40
    assert lost(d, acked) == []       # the first open alone rebuilds it, from the slabs
    assert st.returncode != 0 and "other process" in st.stderr, st.stderr   # refused, said why
    assert glob.glob(str(d / "index.db.damaged-*"))   # set aside then, with no writer beside it


UNSHARE = ("unshare", "--pid", "--fork", "--mount-proc")


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run([*UNSHARE, "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs `unshare --pid` (root or user namespaces)")
def test_a_writer_in_another_pid_namespace_keeps_its_range_and_its_blocks(tmp_path):
    """A container's writer (pid 1 in its own PID namespace) beside host processes: neither
    `cache stats` nor a second writer takes it for dead, and flush() is true only when stored."""
    d = tmp_path / "cache"
    with open_store(d):
        pass
    stop = str(tmp_path / "stop")
    w = proc("stream", d, prefix=UNSHARE, start=0, batch=4, stop=stop, size=SIZE)
    try:
        for _ in range(3):
            assert line(w)["flushed"]
        other = proc("stream", d, start=100_000, batch=4, stop=stop, size=SIZE)
        for _ in range(4):
            st = cache_stats(d)
            assert st.returncode == 0, st.stderr
        time.sleep(0.5)
        Path(stop).touch()
        acked, acked_other = durable_blocks(w), durable_blocks(other)
        assert w.wait(120) == 0 and other.wait(120) == 0
    finally:
        w.kill()
    assert len(acked) > 8 and len(acked_other) > 8
    assert lost(d, acked) == [] and lost(d, acked_other) == []


def test_a_writer_paused_holding_the_write_lock_is_waited_for_never_set_aside(tmp_path):
    d = tmp_path / "cache"
    w = proc("hold", d, stdin=True, n=8, size=SIZE)
    try:
        assert line(w)["flushed"]
        assert line(w)["locked"]
        os.kill(w.pid, signal.SIGSTOP)   # `docker pause`, a cgroup freezer
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="locked by another process"):
            open_store(d, lock_timeout_s=3.0)
        assert time.monotonic() - t0 < 60
        assert not glob.glob(str(d / "index.db.*-*"))   # busy is not damage: nothing set aside
        os.kill(w.pid, signal.SIGCONT)
        w.stdin.write("\n")   # type: ignore[union-attr]
        w.stdin.flush()       # type: ignore[union-attr]
        assert line(w)["released"]
        with open_store(d) as s:   # beside the live writer, its range and namespace intact
            assert s.rebuilt_from is None
            models = [n["description"]["model"] for n in s.summary()["namespaces"]
                      if n["description"]]
            assert models == ["paused"]
        w.stdin.write("\n")   # type: ignore[union-attr]
        w.stdin.flush()       # type: ignore[union-attr]
        assert w.wait(120) == 0
    finally:
        if w.poll() is None:
            os.kill(w.pid, signal.SIGCONT)
            w.kill()
    assert lost(d, list(range(8))) == []


LEASE = """
import sys, time
sys.path.insert(0, sys.argv[2])
from offload.store.disk.owner import Lease
print(Lease(sys.argv[1]).token, flush=True)
time.sleep(600)
"""


def test_a_lease_is_alive_while_its_process_is_even_stopped_and_dead_once_it_is_killed(tmp_path):
    from offload.store.disk.owner import live_leases, owner_alive

    p = subprocess.Popen([sys.executable, "-c", LEASE, str(tmp_path), ROOT], stdout=subprocess.PIPE,
                         text=True)
    try:
        token = p.stdout.readline().strip()   # type: ignore[union-attr]
        assert owner_alive(str(tmp_path), token) and live_leases(str(tmp_path)) == [token]
        os.kill(p.pid, signal.SIGSTOP)        # paused: still alive
        assert owner_alive(str(tmp_path), token)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(60)
        assert not owner_alive(str(tmp_path), token)   # the kernel dropped its lock at death
        assert os.listdir(tmp_path) == []               # and the dead lease is removed
        assert not owner_alive(str(tmp_path), "lease:" + "0" * 32)
    finally:
        p.kill()


def test_openers_with_one_pid_never_take_each_others_o_direct_probe(tmp_path):
    """Two openers with the same pid (processes of two containers sharing the directory; here two
    threads of one process) probe O_DIRECT at once: before, each deleted the other's probe file
    (named by pid) and one create failed, "refuses O_DIRECT: File exists" -- the open failed
    with `o_direct: on`, fell back to buffered I/O with `auto`."""
    import threading

    from offload.errors import StoreError
    from offload.store.disk.slab.fdcache import probe_o_direct

    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    if not probe_o_direct(str(d), "auto"):
        pytest.skip("this file system refuses O_DIRECT")
    refused: list[str] = []

    def probe() -> None:
        for _ in range(300):
            try:
                probe_o_direct(str(d), "on")
            except StoreError as e:
                refused.append(str(e))

    threads = [threading.Thread(target=probe) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not refused, refused[:3]
    assert os.listdir(d) == []   # every probe removed
