"""Holes in `LaunchedServer.stop` (issue 37) and in tests/conftest.py's bytecode caches, each shown
with real processes. The first three are fixed in offload/launch/server.py; the last is CPython's
own default, accepted (xfail strict).

- A /proc that is not this pid namespace's (a container or `unshare --pid` without a /proc of
  its own): `group_members` finds none of the group, so stop kills the leader at once and then
  SIGKILLs the group as "gone": a child's SIGTERM work is cut short.
- A leader alone (no scheduler yet): killed right after the SIGTERM, its handler never runs.
- A second stop (or a kill after a stop), which the e2e `servers` fixture and `bench serve` do
  after a test's own stop, or a stop after a failed start (bench workload's `serve`): it
  signals the group by the old leader's PID, which by then may lead another process group
  (pid_max is 32768 on this box).
- A module rewritten in place with the same size and the same mtime second: with
  PYTHONDONTWRITEBYTECODE popped by tests/conftest.py, the child process that imports it again
  runs the old bytecode.

The pid-namespace tests run their driver under `unshare` (root here); elsewhere they skip."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from offload.launch.server import LaunchedServer

pytestmark = pytest.mark.slow   # pid namespaces, PID reuse; test_server_stop.py stays quick
ROOT = Path(__file__).resolve().parents[2]


def _unshare(args: list[str], driver: str, *argv: str) -> dict[str, object]:
    """Run `driver` (Python, the repository on its path) under `unshare ARGS`; its last line,
    JSON. Skips where pid namespaces cannot be made."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    probe = subprocess.run(["unshare", *args, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare {' '.join(args)}: {probe.stderr.decode().strip()}")
    r = subprocess.run(["nice", "-n", "10", "unshare", *args, sys.executable, "-c", driver, *argv],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


# A leader that ignores SIGTERM, waits for its child (which needs 1 s after SIGTERM to flush, and
# writes a marker) and then exits 3: a stop that waits for the group returns 3 with the marker.
NS_DRIVER = r"""
import json, subprocess, sys
from pathlib import Path
from offload.launch.server import LaunchedServer
from tests.launch.stand_ins import CHILD
LEADER = '''
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, lambda *a: None)
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
while not os.path.exists(sys.argv[2] + ".ready"):
    time.sleep(0.02)
print("up", flush=True)
sys.exit(3 if child.wait() == 0 else 4)
'''
tmp = Path(sys.argv[1])
marker = tmp / "child-flushed"
proc = subprocess.Popen([sys.executable, "-c", LEADER, CHILD, str(marker)],
                        stdout=subprocess.PIPE, start_new_session=True)
assert proc.stdout.readline().strip() == b"up"
rc = LaunchedServer("http://127.0.0.1:1", proc, tmp / "log").stop(grace=60)
print(json.dumps({"rc": rc, "flushed": marker.exists(), "pid": proc.pid}))
"""


def test_a_proc_of_another_pid_namespace_does_not_cut_the_childrens_work_short(tmp_path: Path
                                                                               ) -> None:
    # a new pid namespace whose /proc is still the parent's (no --mount-proc)
    got = _unshare(["--pid", "--fork"], NS_DRIVER, str(tmp_path))
    assert got["flushed"], got
    assert got["rc"] in (3, -signal.SIGKILL), got      # exited, or killed once alone


def test_the_same_driver_with_a_proc_of_its_own_namespace_waits_for_the_child(tmp_path: Path
                                                                              ) -> None:
    """The control: the same namespace with its own /proc; stop waits for the child's flush."""
    got = _unshare(["--pid", "--fork", "--mount-proc"], NS_DRIVER, str(tmp_path))
    assert got["flushed"], got
    assert got["rc"] in (3, -signal.SIGKILL), got      # exited, or killed once alone


# stop() (or the launch exits by itself: a failed start), then a process in a session of its own
# takes the leader's old PID (ns_last_pid, in a pid namespace of the test's own), then stop() or
# kill() on the same LaunchedServer.
REUSE_DRIVER = r"""
import json, subprocess, sys
from pathlib import Path
from offload.launch.server import LaunchedServer
up = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(5))\n" \
     "print('up', flush=True)\ntime.sleep(60)"
tmp = Path(sys.argv[1])
proc = subprocess.Popen([sys.executable, "-c", up], stdout=subprocess.PIPE, start_new_session=True)
assert proc.stdout.readline().strip() == b"up"
server = LaunchedServer("http://127.0.0.1:1", proc, tmp / "log")
if sys.argv[2] == "exited":       # a start that failed: its launch exited, reaped by wait_ready
    proc.send_signal(15)
    first = proc.wait()
else:
    first = server.stop(grace=30)
Path("/proc/sys/kernel/ns_last_pid").write_text(str(proc.pid - 1))
other = subprocess.Popen([sys.executable, "-c", "import sys\nprint('up', flush=True)\n"
                          "sys.stdin.readline()\nprint('pong', flush=True)\nsys.stdin.readline()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
assert other.stdout.readline().strip() == b"up"
second = getattr(server, sys.argv[3])()
try:            # a signal sent by killpg is fatal before the process runs again: no pong then
    other.stdin.write(b"ping\n")
    other.stdin.flush()
except OSError:
    pass
alive = other.stdout.readline().strip() == b"pong"
other.kill()
print(json.dumps({"first": first, "second": second, "reused": other.pid == proc.pid,
                  "other_alive": alive, "other_rc": other.wait()}))
"""


@pytest.mark.parametrize("first,again", [("stop", "stop"), ("stop", "kill"), ("exited", "stop")])
def test_a_second_stop_does_not_signal_a_group_that_took_the_old_pid(tmp_path: Path, first: str,
                                                                     again: str) -> None:
    got = _unshare(["--pid", "--fork", "--mount-proc"], REUSE_DRIVER, str(tmp_path), first, again)
    if not got["reused"]:
        pytest.skip(f"the PID was not reused: {got}")
    assert got["second"] == got["first"], got    # the first stop's status, nothing signalled
    assert got["other_alive"], got               # the process now at that PID untouched


def test_a_leader_alone_gets_to_handle_its_sigterm(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                             "signal.signal(signal.SIGTERM, lambda *a: sys.exit(5))\n"
                             "print('up', flush=True)\ntime.sleep(60)"],
                            stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"up"
    assert LaunchedServer("http://127.0.0.1:1", proc, tmp_path / "log").stop(grace=60) == 5


@pytest.mark.xfail(strict=True, reason="accepted: CPython's own default (a .pyc keyed by its "
                   "source's size and mtime in whole seconds), which tests/conftest.py restores "
                   "where the environment turned bytecode off; no test rewrites a module in place "
                   "(shadow trees are rebuilt from scratch, scripts go to fresh tmp paths)")
def test_a_module_rewritten_with_the_same_size_and_mtime_is_not_run_from_stale_bytecode(
        tmp_path: Path) -> None:
    started_with = Path("/proc/self/environ").read_bytes().split(b"\0")   # before conftest's pop
    if not any(v.startswith(b"PYTHONDONTWRITEBYTECODE=") for v in started_with):
        pytest.skip("the environment does not set PYTHONDONTWRITEBYTECODE: Python's default")
    mod = tmp_path / "rewritten_mod.py"
    run = [sys.executable, "-c", "import rewritten_mod; print(rewritten_mod.X)"]
    mod.write_text("X = 1\n")
    stamp = int(mod.stat().st_mtime)
    os.utime(mod, (stamp, stamp))
    first = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, check=True)
    assert first.stdout.strip() == "1"
    mod.write_text("X = 2\n")          # a rebuilt tree, or a test's rewrite in the same second
    os.utime(mod, (stamp, stamp))
    second = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, check=True)
    assert second.stdout.strip() == "2"
