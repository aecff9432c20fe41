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

Primitives: `check_metadata(md)` -> None or why not; `Vetter(timeout_s)`; `.vet(md)` -> None or
why not (never raises; metadata vetted before is not sent again: `CACHE` digests); `.close()`.
The child is `python -m offload.agent.vet`: frames on its stdin (u32 length, the metadata), one
reply each on its stdout (a status byte, u32 length, the message); no pickling.
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

log = logging.getLogger(__name__)

MAX_METADATA = 1 << 20          # bytes of one metadata blob (the HELLO's frame bounds it too)
CACHE = 1024                    # digests of metadata vetted good, kept
VET_TIMEOUT_S = 10.0            # the child's answer for one metadata (UCX may try to connect)
START_TIMEOUT_S = 60.0          # the child's start (imports NIXL, creates its agent)
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


class Vetter:
    """Loads metadata in a child NIXL agent first; serialised, restarted when a load kills it."""

    def __init__(self, timeout_s: float = VET_TIMEOUT_S):
        self.timeout_s = timeout_s
        self.crashes = 0                  # children a metadata load killed
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None
        self._good: OrderedDict[bytes, None] = OrderedDict()
        self._closed = False

    def start(self) -> None:
        """Start the child now (it imports NIXL meanwhile); `vet` starts it otherwise."""
        with self._lock:
            self._spawn()

    def _spawn(self) -> subprocess.Popen | None:
        if self._child is not None and self._child.poll() is None:
            return self._child
        if self._closed:
            return None
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-m", "offload.agent.vet"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=dict(os.environ),
                close_fds=True)
        except OSError as e:
            log.warning("cannot start the NIXL metadata checker: %s", e)
            self._child = None
            return None
        self._ready = False
        return self._child

    def vet(self, md: bytes) -> str | None:
        """None if `md` loads in a NIXL agent without harm, else why not. Never raises."""
        why = check_metadata(md)
        if why is not None:
            return why
        digest = hashlib.sha256(md).digest()
        with self._lock:
            if digest in self._good:
                self._good.move_to_end(digest)
                return None
            why = self._ask(md)
            if why is None:
                self._good[digest] = None
                while len(self._good) > CACHE:
                    self._good.popitem(last=False)
            return why

    def _ask(self, md: bytes) -> str | None:
        child = self._spawn()
        if child is None or child.stdin is None or child.stdout is None:
            return "the NIXL metadata checker is not running"
        try:
            if not self._ready:
                if _read(child, 1, time.monotonic() + START_TIMEOUT_S) != READY:
                    raise EOFError("the checker did not start")
                self._ready = True
            child.stdin.write(_LEN.pack(len(md)) + md)
            child.stdin.flush()
            end = time.monotonic() + self.timeout_s
            status = _read(child, 1, end)
            n = _LEN.unpack(_read(child, _LEN.size, end))[0]
            msg = _read(child, min(n, 4096), end).decode(errors="replace")
        except TimeoutError:
            self._kill(child)
            return f"NIXL metadata not loaded within {self.timeout_s:g}s by the checker"
        except (EOFError, OSError) as e:
            self._kill(child)
            code = child.returncode
            if code is not None and code < 0:
                self.crashes += 1
                return f"NIXL metadata that crashes UCX (the checker died of signal {-code})"
            return f"NIXL metadata not checked ({e or type(e).__name__})"
        return None if status == b"1" else f"NIXL metadata rejected: {msg}"

    def _kill(self, child: subprocess.Popen) -> None:
        if child.poll() is None:
            child.kill()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._child = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._child is not None:
                self._kill(self._child)


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
    from offload.agent import nixl_util

    agent = nixl_util.make_agent(f"sglang-offload-vet-{os.getpid()}")
    inp, out = sys.stdin.buffer, sys.stdout.buffer
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
