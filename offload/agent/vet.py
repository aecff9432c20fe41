"""Tenant NIXL metadata checked before the agent loads it: what can be checked here, the rest by
loading it first in a child process whose crash costs only the metadata's sender.

A host's metadata is parsed by NIXL and UCX in the agent's own process when it is loaded
(`add_remote_agent`), and UCX asserts on some malformed worker addresses (8 bytes changed at the
start of one: `address.c` aborts the process, every tenant loses service). What the agent can
check without UCX it checks (`check_metadata`: a `nixlSerDes` header with an agent name, a UCX
connection section inside the blob, its worker address of the version UCX unpacks); what
only UCX can check is tried by a child process that loads the metadata into its own NIXL agent
(`Vetter`): if UCX aborts there, the child dies, the metadata is refused and the child is
started again; the agent never loads what the child could not.

Primitives: `check_metadata(md)` -> None or why not; `Vetter(timeout_s, children=, budget_s=,
rate_s=)`; `.vet(md, owner)` -> None or why not (never raises; metadata vetted before is not sent
again: `CACHE` digests); `.left(owner)` -> checker seconds the key may spend now; `.close()`.
Checker time is the key's (`owner`, a host key): `budget_s` at once then `rate_s` per second,
`timeout_s` taken before a check starts and the unused part given back; one check per key at a
time, in a pool of at most `children` children (no lock is held across another key's check).
The child is `python -m offload.agent.vet`: frames on its stdin (u32 length, the metadata), one
reply each on its reply descriptor (a status byte, u32 length, the message; the pipe that was
its stdout, which it points at /dev/null before loading NIXL, so nothing UCX prints can land in
a reply); no pickling.
"""

from __future__ import annotations

import hashlib
import logging
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from typing import Callable

log = logging.getLogger(__name__)

MAX_METADATA = 1 << 20          # bytes of one metadata blob (the HELLO's frame bounds it too)
HELD_PER_BYTE = 10              # bytes the agent holds per byte of metadata it loaded: the
                                # bytes, and NIXL's remote agent (7.2 measured: 20,000 regions)
CACHE = 1024                    # digests of metadata vetted good, kept
VET_TIMEOUT_S = 10.0            # the child's answer for one metadata (UCX may try to connect)
START_TIMEOUT_S = 60.0          # the child's start (imports NIXL, creates its agent)
CHILDREN = 4                    # checkers at most (one per host key at a time)
WARM = 2                        # ... started with the agent
KEY_BUDGET_S = 30.0             # checker seconds one host key may spend at once
KEY_RATE_S = 1.0                # ... and per second after that (a check costs ~1 ms)
MAX_REPLY = 4096                # bytes of a checker's message
UCP_ADDRESS_VERSIONS = (0, 1)   # UCP_OBJECT_VERSION_V1, _V2: the low 4 bits of an address's
                                # first byte, which UCX asserts on when it unpacks it
_LEN = struct.Struct("<I")
READY = b"R"


_UCX_CONN = b"|t" + (3).to_bytes(8, "little") + b"UCX|c"     # the UCX backend's connection info


def check_metadata(md: bytes) -> str | None:
    """What can be checked of NIXL metadata without loading it: None if it may be loaded.
    (Its layout is tag, u64-LE length, value, `|`, with tags known only to the reader: the agent
    name, and the UCX worker address UCX unpacks, are found by their known tags.)"""
    from offload.agent.nixl_util import metadata_name

    if len(md) > MAX_METADATA:
        return f"{len(md)} bytes of NIXL metadata (at most {MAX_METADATA})"
    if metadata_name(md) is None:
        return "not NIXL metadata (no nixlSerDes header with an agent name)"
    addr = worker_address(md)
    if addr is None:
        return "NIXL metadata without UCX connection info"
    if not addr:
        return "the UCX worker address in the NIXL metadata runs past its end"
    if addr[0] & 0xF not in UCP_ADDRESS_VERSIONS:
        return "the UCX worker address in the NIXL metadata is of an unknown version"
    return None


def worker_address(md: bytes) -> bytes | None:
    """The UCX worker address in NIXL metadata (b"" if it runs past the end), None if none."""
    i = md.find(_UCX_CONN)
    if i < 0:
        return None
    start = i + len(_UCX_CONN) + 8
    n = int.from_bytes(md[start - 8:start], "little")
    if start > len(md) or n == 0 or n > len(md) - start:
        return b""
    return md[start:start + n]


class _Checker:
    """One child process (`python -m offload.agent.vet`) and whether it said it is ready."""

    def __init__(self, child: subprocess.Popen):
        self.child = child
        self.ready = False

    def alive(self) -> bool:
        return self.child.poll() is None


class Vetter:
    """Loads metadata in a child NIXL agent first; a pool of children, each key's time charged.

    Each host key (`owner`) has its own checker time: `budget_s` seconds at once, then `rate_s`
    per second; a check takes `timeout_s` of it before it starts and gives back what it did not
    use, so a key whose metadata keeps the checker waiting is refused (its own requests), never
    another key. One key has at most one check running (its next waits for it: its own wait);
    checks of different keys run in different children (at most `children`; a key waits for a
    free one only while every child checks another key's metadata, each for at most
    `timeout_s`)."""

    def __init__(self, timeout_s: float = VET_TIMEOUT_S, children: int = CHILDREN,
                 budget_s: float = KEY_BUDGET_S, rate_s: float = KEY_RATE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.timeout_s = timeout_s
        self.children, self.budget_s, self.rate_s = children, budget_s, rate_s
        self._clock = clock
        self.crashes = 0                  # children a metadata load killed
        self._lock = threading.Condition()
        self._idle: list[_Checker] = []   # children not checking anything now
        self._count = 0                   # children started or starting, idle or busy
        self._busy: set[str] = set()      # keys with a check running
        self._time: dict[str, tuple[float, float]] = {}   # key -> (checker seconds left, at)
        self._good: OrderedDict[bytes, None] = OrderedDict()
        self._closed = False

    def start(self) -> None:
        """Start `WARM` children now (they import NIXL meanwhile): a second key's check finds
        one ready while a first runs; more start as keys need them, one kept spare."""
        with self._lock:
            while self._count < min(WARM, self.children):
                checker = self._spawn()
                if checker is None:
                    break
                self._idle.append(checker)

    def _spawn(self) -> _Checker | None:
        """A new child, counted (lock held); None if it cannot start."""
        if self._closed:
            return None
        try:
            child = subprocess.Popen(
                [sys.executable, "-m", "offload.agent.vet"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=dict(os.environ),
                close_fds=True)
        except OSError as e:
            log.warning("cannot start the NIXL metadata checker: %s", e)
            return None
        self._count += 1
        return _Checker(child)

    def left(self, owner: str) -> float:
        """Checker seconds `owner` may spend now."""
        with self._lock:
            return self._refill(owner)

    def _refill(self, owner: str) -> float:
        now = self._clock()
        left, at = self._time.get(owner, (self.budget_s, now))
        left = min(self.budget_s, left + (now - at) * self.rate_s)
        self._time[owner] = (left, now)
        return left

    def _charge(self, owner: str, seconds: float) -> None:
        left, at = self._time[owner]
        self._time[owner] = (min(self.budget_s, left - seconds), at)
        if self._time[owner][0] >= self.budget_s and owner not in self._busy:
            del self._time[owner]            # full again: nothing to remember

    def vet(self, md: bytes, owner: str = "") -> str | None:
        """None if `md` loads in a NIXL agent without harm, else why not. Never raises."""
        why = check_metadata(md)
        if why is not None:
            return why
        digest = hashlib.sha256(md).digest()
        with self._lock:
            if digest in self._good:
                self._good.move_to_end(digest)
                return None
            # The key's own earlier check first (its own wait), then its time, then a child.
            end = self._clock() + 2 * self.timeout_s + START_TIMEOUT_S
            while owner in self._busy:
                if not self._lock.wait(max(0.0, end - self._clock())):
                    return "a check of this host key's NIXL metadata is still running"
            if self._refill(owner) < self.timeout_s:
                return (f"this host key spent its NIXL metadata checker time (at most "
                        f"{self.budget_s:g}s, then {self.rate_s:g}s per second); retry later")
            self._busy.add(owner)
            self._charge(owner, self.timeout_s)
            checker = None
            while checker is None and not self._closed:
                if self._idle:
                    checker = self._idle.pop()
                    if not self._idle and self._count < self.children:
                        spare = self._spawn()        # warm for the next key meanwhile
                        if spare is not None:
                            self._idle.append(spare)
                elif self._count < self.children:
                    checker = self._spawn()
                    if checker is None:
                        break
                elif not self._lock.wait(max(0.0, end - self._clock())):
                    break
        used, verdict = 0.0, "not checked"
        try:
            if checker is None:
                return "the NIXL metadata checker is not running"
            answer, used = self._ask(checker, md)
            verdict = answer or ""
            return answer
        finally:
            dead = None
            with self._lock:
                # What it did not use goes back (a check is stopped at `timeout_s`).
                self._charge(owner, min(used, self.timeout_s) - self.timeout_s)
                self._busy.discard(owner)
                if checker is not None:
                    if checker.alive() and not self._closed:
                        self._idle.append(checker)
                    else:
                        self._count -= 1
                        dead = checker
                if verdict == "":
                    self._good[digest] = None
                    while len(self._good) > CACHE:
                        self._good.popitem(last=False)
                self._lock.notify_all()
            if dead is not None:
                self._kill(dead)

    def _ask(self, checker: _Checker, md: bytes) -> tuple[str | None, float]:
        """Why the child could not load `md` (None: it could), and the seconds it took."""
        child = checker.child
        if child.stdin is None or child.stdout is None:
            return "the NIXL metadata checker is not running", 0.0
        t0 = time.monotonic()
        try:
            if not checker.ready:
                if _read(child, 1, time.monotonic() + START_TIMEOUT_S) != READY:
                    raise EOFError("the checker did not start")
                checker.ready = True
            t0 = time.monotonic()
            child.stdin.write(_LEN.pack(len(md)) + md)
            child.stdin.flush()
            end = t0 + self.timeout_s
            status = _read(child, 1, end)
            n = _LEN.unpack(_read(child, _LEN.size, end))[0]
            if status not in (b"0", b"1") or n > MAX_REPLY:
                raise EOFError("the checker's reply is garbled")
            msg = _read(child, n, end).decode(errors="replace")
        except TimeoutError:
            self._kill(checker)
            return (f"NIXL metadata not loaded within {self.timeout_s:g}s by the checker",
                    time.monotonic() - t0)
        except (EOFError, OSError) as e:
            self._kill(checker)
            code = child.returncode
            # A check that cost the checker its life costs its key the whole check: the restart
            # (NIXL imported again, a new agent) is its doing (before, a crash cost ~1 ms of
            # the key's time and the agent a process start).
            used = max(time.monotonic() - t0, self.timeout_s)
            if code is not None and code < 0 and "garbled" not in str(e):
                self.crashes += 1
                return f"NIXL metadata that crashes UCX (the checker died of signal {-code})", used
            return f"NIXL metadata not checked ({e or type(e).__name__})", used
        return (None if status == b"1" else f"NIXL metadata rejected: {msg}"), time.monotonic() - t0

    @staticmethod
    def _kill(checker: _Checker) -> None:
        child = checker.child
        if child.poll() is None:
            child.kill()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._lock.notify_all()
        for checker in idle:
            self._kill(checker)


def _read(child: subprocess.Popen, n: int, deadline: float) -> bytes:
    assert child.stdout is not None
    fd = child.stdout.fileno()
    out = b""
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the checker did not answer in time")
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, n - len(out))
        if not chunk:
            try:
                child.wait(5)
            except subprocess.TimeoutExpired:
                pass
            raise EOFError("the checker exited")
        out += chunk
    return out


def _child_main() -> int:
    """The checker: load each metadata into a NIXL agent of its own, then forget it."""
    # Replies go on a descriptor of their own; what UCX or NIXL print on stdout (UCX writes
    # "connect failed" for a peer that has gone) goes nowhere, never into a reply.
    out = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    from offload.agent import nixl_util

    agent = nixl_util.make_agent(f"sglang-offload-vet-{os.getpid()}")
    inp = sys.stdin.buffer
    out.write(READY)
    out.flush()
    while True:
        head = inp.read(_LEN.size)
        if len(head) < _LEN.size:
            return 0
        md = inp.read(_LEN.unpack(head)[0])
        try:
            name = agent.add_remote_agent(md)
            agent.remove_remote_agent(name.decode() if isinstance(name, bytes) else str(name))
            status, msg = b"1", b""
        except Exception as e:  # noqa: BLE001 - NIXL raises its own types
            status, msg = b"0", str(e).encode()[:4096]
        out.write(status + _LEN.pack(len(msg)) + msg)
        out.flush()


if __name__ == "__main__":
    sys.exit(_child_main())
