"""Bounds on one call to Redis: a deadline for the whole call and an allowance of reply bytes.

A socket timeout bounds one `recv`, not a call: a server answering one byte every 0.3 s never
trips a 0.5 s timeout and holds a call for minutes. So every call carries bounds, and the
socket under redis-py enforces them on each operation.

Primitives:
- `CallBounds`: per thread, the current call's `deadline` (monotonic seconds) and `recv_left`
  (reply bytes it may still receive); None outside a call. `bounds.call(seconds, recv_bytes)`
  sets them for a `with` block; a call nested inside another keeps the outer (tighter) bounds.
- `BoundedSocket(sock, bounds)`: wraps the socket redis-py connects (plain or TLS). Before
  each operation it lowers the socket timeout to the time left; past the deadline it raises
  `socket.timeout` (redis-py turns that into its `TimeoutError` and disconnects). A reply
  longer than the allowance raises `ReplyTooLong` (an `OSError`: redis-py disconnects), so no
  reply makes this process buffer more than the call expected, whatever length it announces.
- `ProtocolError`: a reply stream that does not match what was sent (an extra or missing reply,
  a reply of the wrong type). The link drops the connection, so the next call starts in step.
- `call_seconds(timeout_s, nbytes)`: the deadline of a call that moves `nbytes`:
  `timeout_s + nbytes / MIN_RATE` (MIN_RATE = 128 MiB/s: a link slower than that is a failure).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

MIN_RATE = 128 << 20          # bytes/s a call may move below before its deadline passes
RECV_SLACK = 1 << 20          # reply bytes allowed beyond what a call expects (framing, errors)
REPLY_BYTES_PER_COMMAND = 256  # allowance per command for its framing and a short error reply
CONTROL_RECV_BYTES = 64 << 20  # allowance of a control-path call (SCAN pages, stats, scripts)


class ProtocolError(OSError):
    """The reply stream is out of step with the commands sent: drop the connection."""


class ReplyTooLong(OSError):
    """A reply longer than the call allows (a value we did not write, a hostile server)."""


def call_seconds(timeout_s: float, nbytes: int = 0) -> float:
    """How long a call moving `nbytes` (sent plus received) may take in all."""
    return timeout_s + nbytes / MIN_RATE


class CallBounds(threading.local):
    deadline: float | None = None
    recv_left: int | None = None

    @contextmanager
    def call(self, seconds: float, recv_bytes: int) -> Iterator[None]:
        """Bound the calls made in this block (this thread): all of them end within `seconds`
        and receive at most `recv_bytes` + RECV_SLACK. Inside another `call`: the outer holds."""
        if self.deadline is not None:
            yield
            return
        self.deadline = time.monotonic() + seconds
        self.recv_left = recv_bytes + RECV_SLACK
        try:
            yield
        finally:
            self.deadline = self.recv_left = None


class BoundedSocket:
    """A connected socket whose operations end by the current call's deadline and whose reads
    stop at the call's reply allowance. Everything else is the wrapped socket's."""

    def __init__(self, sock: Any, bounds: CallBounds):
        self._sock = sock
        self._bounds = bounds
        self._timeout: float | None = sock.gettimeout()
        self._clamped = False

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout
        self._clamped = False
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._timeout

    def _arm(self) -> None:
        deadline = self._bounds.deadline
        if deadline is None:
            if self._clamped:
                self._clamped = False
                self._sock.settimeout(self._timeout)
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call's deadline passed")
        t = self._timeout
        self._clamped = True
        self._sock.settimeout(left if t is None else min(t, left))

    def _received(self, n: int) -> None:
        left = self._bounds.recv_left
        if left is not None:
            left -= n
            self._bounds.recv_left = left
            if left < 0:
                raise ReplyTooLong("the reply is longer than this call allows")

    def recv(self, bufsize: int, *flags: int) -> bytes:
        self._arm()
        data: bytes = self._sock.recv(bufsize, *flags)
        self._received(len(data))
        return data

    def recv_into(self, buf: Any, nbytes: int = 0, *flags: int) -> int:
        self._arm()
        n: int = self._sock.recv_into(buf, nbytes, *flags)
        self._received(n)
        return n

    def sendall(self, data: Any, *flags: int) -> None:
        self._arm()
        self._sock.sendall(data, *flags)

    def send(self, data: Any, *flags: int) -> int:
        self._arm()
        return int(self._sock.send(data, *flags))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)
