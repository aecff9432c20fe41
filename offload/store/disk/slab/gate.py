"""Reads before writes at the device: one process's gate in front of its slab I/O.

A read's O_DIRECT `preadv` goes to the same device queue as the write-back's `pwritev`s and the
group committer's `fdatasync`s; once megabytes of writes are queued there, a read waits for them
(measured on the development VM's disk: a read p90 of ~1 s beside a write-back that had 8 x
16 MiB writes and a flush in flight). The gate keeps what is queued ahead of a read small:

- `reading()`: a read holds it while its calls run; reads never wait at the gate.
- `writing(nbytes)`: a write call (at most a piece of a run: `files.WRITE_PIECE_BYTES`) holds it
  while it runs. While a read is in flight, a write waits until the writes in flight leave room
  for it under `floor_bytes` (`WRITE_FLOOR_BYTES`, one piece), so about a piece is queued ahead
  of a read; a write alone in flight always moves (the floor: writes still progress); with no
  read in flight, writes run as the I/O threads allow.
- `quiet(timeout)`: the group committer calls it before a round's flushes (the slabs'
  `fdatasync`, the index's synced commit): it waits until no read is in flight, at most
  `timeout` (`QUIET_WAIT_S`; the round then goes on: durability is delayed, never given up).

Nothing here decides what is durable or visible; the gate only orders calls. Primitives:
`IoGate(floor_bytes, quiet_wait_s)` with `reading`, `writing`, `quiet`, `state()` (reads in
flight, write bytes in flight, writers waiting: for tests and stats).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, NamedTuple

WRITE_FLOOR_BYTES = 1 << 20   # write bytes in flight beside a read (at least one call moves)
QUIET_WAIT_S = 0.05           # a commit round's flushes wait at most this long for reads


class GateState(NamedTuple):
    reads: int            # read calls in flight
    write_bytes: int      # bytes of write calls in flight
    writers_waiting: int  # write calls held back by reads


class IoGate:
    def __init__(self, floor_bytes: int = WRITE_FLOOR_BYTES,
                 quiet_wait_s: float = QUIET_WAIT_S) -> None:
        self.floor_bytes, self.quiet_wait_s = floor_bytes, quiet_wait_s
        self._cond = threading.Condition()
        self._reads = 0
        self._write_bytes = 0
        self._writes = 0
        self._writers_waiting = 0
        self.writes_held = 0       # write calls that waited for a read (a counter)
        self.quiet_waits = 0       # commit rounds that waited for reads (a counter)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """A read call in flight: later writes queue behind it, one piece at a time."""
        with self._cond:
            self._reads += 1
        try:
            yield
        finally:
            with self._cond:
                self._reads -= 1
                if not self._reads:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def writing(self, nbytes: int) -> Iterator[None]:
        """A write call of `nbytes` in flight; while a read is, it first waits for the other
        writes in flight to finish (never for the read itself: one piece always moves)."""
        with self._cond:
            if self._held_back(nbytes):
                self.writes_held += 1
                self._writers_waiting += 1
                try:
                    while self._held_back(nbytes):
                        self._cond.wait()
                finally:
                    self._writers_waiting -= 1
            self._writes += 1
            self._write_bytes += nbytes
        try:
            yield
        finally:
            with self._cond:
                self._writes -= 1
                self._write_bytes -= nbytes
                self._cond.notify_all()

    def _held_back(self, nbytes: int) -> bool:
        """While a read is in flight, a write waits for room under the floor (under the lock);
        alone in flight it always moves."""
        return bool(self._reads and self._writes
                    and self._write_bytes + nbytes > self.floor_bytes)

    def quiet(self, timeout: float | None = None) -> bool:
        """Wait until no read is in flight, at most `timeout` (default: `quiet_wait_s`): whether
        none is."""
        if timeout is None:
            timeout = self.quiet_wait_s
        with self._cond:
            if not self._reads:
                return True
            self.quiet_waits += 1
            end = time.monotonic() + timeout
            while self._reads:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def state(self) -> GateState:
        with self._cond:
            return GateState(self._reads, self._write_bytes, self._writers_waiting)


__all__ = ["GateState", "IoGate", "QUIET_WAIT_S"]
