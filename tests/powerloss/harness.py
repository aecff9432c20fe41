"""Power cuts on demand: mount `lazyfs.py` over a backing directory, run a writer, cut, remount, check.

Primitives: `lazyfs_unavailable()` (why these tests cannot run here, or ''), `LazyMount` (mount /
`cut`: SIGKILL of the file system process, then a lazy unmount), `Writer` (a writer process, its
`VERIFIED` line and `ACK` lines; see writer.py), `Rounds` (the loop: mount -> writer verifies every
page acknowledged so far -> writes -> cut at a random moment -> repeat; `Rounds.losses` lists
every acknowledged page a later round could not read back exactly).
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
LAZYFS = HERE / "lazyfs.py"
WRITER = HERE / "writer.py"


@functools.cache
def lazyfs_unavailable() -> str:
    """'' if a FUSE file system can be mounted here, else why not (the skip reason)."""
    import importlib.util
    import tempfile

    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (FUSE unavailable in this container)"
    if shutil.which("fusermount3") is None and shutil.which("fusermount") is None:
        return "no fusermount3 (Debian package fuse3)"
    if importlib.util.find_spec("mfusepy") is None:
        return "the FUSE binding mfusepy is not installed (pip install -e '.[test]')"
    probe = subprocess.run([sys.executable, "-c", "import mfusepy"], capture_output=True, text=True)
    if probe.returncode:
        return f"mfusepy cannot load libfuse (Debian libfuse3-3): {probe.stderr.strip()[-200:]}"
    with tempfile.TemporaryDirectory(prefix="lazyfs-probe-") as tmp:
        m = LazyMount(Path(tmp) / "backing", Path(tmp) / "mnt", Path(tmp) / "log", timeout=10.0)
        try:
            m.mount()
        except RuntimeError as e:
            return f"cannot mount a FUSE file system here (no CAP_SYS_ADMIN?): {str(e)[-300:]}"
        finally:
            m.cut()
            shutil.rmtree(str(m.backing) + ".inodes", ignore_errors=True)
    return ""


class LazyMount:
    """`lazyfs.py BACKING MOUNTPOINT` as a separate process."""

    def __init__(self, backing: Path, mountpoint: Path, log: Path, writeback: float = 0.0,
                 timeout: float = 20.0):
        self.backing, self.mountpoint, self.log, self.timeout = backing, mountpoint, log, timeout
        self.writeback = writeback    # lazyfs's chance of an early writeback per operation
        self.mounts = 0
        self.proc: subprocess.Popen | None = None
        backing.mkdir(mode=0o700, parents=True, exist_ok=True)
        mountpoint.mkdir(parents=True, exist_ok=True)

    def mount(self) -> None:
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen([sys.executable, str(LAZYFS), str(self.backing),
                                          str(self.mountpoint), str(self.writeback),
                                          str(self.mounts)], stdout=logf, stderr=logf)
        self.mounts += 1
        end = time.monotonic() + self.timeout
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.cut()
                raise RuntimeError(f"lazyfs did not mount: {self.log.read_text()[-2000:]}")
            time.sleep(0.02)

    def cut(self) -> None:
        """The power cut: the file system process dies, what it held in memory is gone."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None
        if os.path.ismount(self.mountpoint) or _stale_mount(self.mountpoint):
            tool = shutil.which("fusermount3") or "fusermount"
            subprocess.run([tool, "-u", "-z", str(self.mountpoint)], capture_output=True)


def _stale_mount(path: Path) -> bool:
    try:
        os.stat(path)
        return False
    except OSError:      # ENOTCONN: a dead FUSE mount
        return True


class Writer:
    """writer.py in a separate process; stdout read by a thread (ACK lines survive the kill)."""

    def __init__(self, opts: dict, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen([sys.executable, str(WRITER), json.dumps(opts)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env)
        self.lines: list[str] = []
        self.verified = threading.Event()
        self._err: list[str] = []
        self._threads = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._read_err, daemon=True)]
        for t in self._threads:
            t.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("VERIFIED "):
                self.verified.set()
        self.verified.set()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._err.append(line)
            del self._err[:-200]

    def wait_verified(self, timeout: float) -> dict:
        self.verified.wait(timeout)
        for line in self.lines:
            if line.startswith("VERIFIED "):
                return json.loads(line[len("VERIFIED "):])
        self.kill()
        raise RuntimeError(f"writer did not verify (rc {self.proc.returncode}): "
                           f"{''.join(self._err)[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        for t in self._threads:
            t.join(5)

    def acked(self) -> list[str]:
        return [line[4:] for line in self.lines if line.startswith("ACK ")]

    def stderr(self) -> str:
        return "".join(self._err)


@dataclass
class Rounds:
    """Cut-and-check rounds on one backing directory.

    `start_writer(opts)` starts the writer of a round (and whatever it talks to: an agent), with
    `opts` holding `dir`, `acked`, `tag`, `write`; `stop_extra()` kills what it started beside.
    `damage(backing)` runs after each cut (the index-rebuild tests delete the index there).
    `writeback`: lazyfs's chance per operation of persisting some unsynced change early.
    """

    tmp: Path
    mode: str
    start_writer: Callable[[dict], Writer] | None = None
    stop_extra: Callable[[], None] = lambda: None
    damage: Callable[[Path], None] = lambda _: None
    seed: int = 0
    writeback: float = 0.0
    verify_timeout: float = 120.0
    acked: list[str] = field(default_factory=list)
    losses: list[tuple[int, str, str]] = field(default_factory=list)   # (round, name, how)
    rounds: int = 0

    def __post_init__(self) -> None:
        self.backing = self.tmp / "backing"
        self.mount = LazyMount(self.backing, self.tmp / "mnt", self.tmp / "lazyfs.log",
                               self.writeback)
        self.acked_file = self.tmp / "acked.txt"
        self.rng = random.Random(self.seed)

    def _writer(self, opts: dict) -> Writer:
        if self.start_writer is not None:
            return self.start_writer(opts)
        return Writer(opts)

    def one(self, write: bool, cut_after: tuple[float, float] = (0.3, 1.5)) -> dict:
        """One round: mount, verify, write for a random time, cut. Returns the VERIFIED result."""
        self.acked_file.write_text("".join(n + "\n" for n in self.acked))
        self.mount.mount()
        writer = None
        try:
            writer = self._writer({"mode": self.mode, "dir": str(self.mount.mountpoint),
                                   "acked": str(self.acked_file), "tag": self.rounds, "write": write})
            got = writer.wait_verified(self.verify_timeout)
            for how in ("lost", "wrong"):
                self.losses += [(self.rounds, n, how) for n in got[how]]
            if write:
                time.sleep(self.rng.uniform(*cut_after))
        finally:
            self.mount.cut()            # the power goes: first the file system, then the processes
            if writer is not None:
                writer.kill()
            self.stop_extra()
            self.mount.cut()            # unmount, if a writer re-touched the dead mount
        if writer is not None:
            self.acked += writer.acked()
        self.damage(self.backing)
        self.rounds += 1
        return got

    def run(self, cuts: int) -> "Rounds":
        for _ in range(cuts):
            self.one(write=True)
        self.one(write=False)      # after the last cut: check everything once more
        return self

    def lost(self) -> dict[str, str]:
        """Each acknowledged page some later round could not read back exactly: how, when first."""
        out: dict[str, str] = {}
        for r, n, how in self.losses:
            out.setdefault(n, f"{how} after cut {r}")
        return out

    def report(self) -> str:
        lost = self.lost()
        return (f"{len(lost)} of {len(self.acked)} acknowledged pages not read back exactly after "
                f"{self.rounds - 1} power cuts (backing directory {self.backing}): "
                f"{sorted(lost.items())[:10]}")
