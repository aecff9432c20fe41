"""`LaunchedServer.stop`: the group gets SIGTERM, every process but the leader is waited for, and a
leader left alone is killed instead of waited out (SGLang's main process sleeps 5 s "before crash
diagnostics" once its scheduler exits on the SIGTERM). Stand-in processes, real signals."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from offload.launch.server import LaunchedServer, group_members, outlives_its_leader
from tests.launch.stand_ins import CHILD, LEADER


def _server(tmp_path: Path, diagnostics_s: float = 120) -> tuple[LaunchedServer, Path]:
    marker = tmp_path / "child-flushed"
    proc = subprocess.Popen([sys.executable, "-c", LEADER, CHILD, str(marker), str(diagnostics_s)],
                            stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"up"
    return LaunchedServer("http://127.0.0.1:1", proc, tmp_path / "log"), marker


def test_the_children_finish_and_a_leader_left_alone_is_killed_not_waited_out(tmp_path: Path
                                                                              ) -> None:
    server, marker = _server(tmp_path)
    assert server.proc is not None
    others = group_members(server.proc.pid, but=server.proc.pid)
    assert sorted(outlives_its_leader(p) for p in others) == [False, True]   # child, tracker
    rc = server.stop(grace=300)
    assert marker.read_text() == "flushed"      # the child's SIGTERM work was waited for
    assert rc == -signal.SIGKILL                # the leader killed, not its 120 s sleep waited out
    assert group_members(server.proc.pid) == []     # the tracker exited by itself


def test_group_members_reads_proc_and_skips_zombies_and_the_leader(tmp_path: Path) -> None:
    proc = tmp_path / "proc"

    def entry(pid: int, comm: str, state: str, pgrp: int) -> None:
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(f"{pid} ({comm}) {state} 1 {pgrp} {pgrp} 0 -1\n")

    entry(100, "python", "S", 100)              # the leader
    entry(101, "sglang::sched) R 1 100", "S", 100)   # a comm holding ") " and digits
    entry(102, "detok", "Z", 100)               # exited, not yet reaped
    entry(103, "other", "R", 7)                 # another group
    (proc / "self").mkdir()
    assert sorted(group_members(100, proc=proc)) == [100, 101]
    assert group_members(100, but=100, proc=proc) == [101]
    assert group_members(7, proc=proc) == [103]
    assert group_members(100, proc=tmp_path / "no-proc") is None      # no /proc: not known


def test_where_the_group_is_not_known_stop_waits_for_the_leader_as_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import offload.launch.server as server_mod

    monkeypatch.setattr(server_mod, "group_members", lambda *a, **k: None)   # no /proc
    server, marker = _server(tmp_path, diagnostics_s=1.0)
    assert server.stop(grace=300) == 3          # the leader's own exit: waited for, not killed
    assert marker.read_text() == "flushed"


def test_only_the_resource_tracker_outlives_its_leader(tmp_path: Path) -> None:
    for pid, cmd in ((1, b"python\0-c\0from multiprocessing.resource_tracker import main;main(5)\0"),
                     (2, b"python\0-m\0sglang.launch_server\0"), (3, b"")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(cmd)
    assert outlives_its_leader(1, proc=tmp_path)
    assert not outlives_its_leader(2, proc=tmp_path) and not outlives_its_leader(3, proc=tmp_path)
    assert outlives_its_leader(4, proc=tmp_path)           # gone meanwhile
