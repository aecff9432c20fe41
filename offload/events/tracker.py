"""`L3Events`: the backend's KV-event queue for L3 (`DISK` / `EXTERNAL`), fed by a thread.

The data path only appends: `stored(keys, ok, prefix_keys)` queues a backup call's page keys (no
I/O); the thread makes their rows (block keys by `make_keys`). A daemon thread (`offload-kv-
events`), every `interval_s`, hands those rows to each source (the ledger write, the Redis
announcement), polls every source for changes (its own and other processes' / replicas'), and
queues SGLang event objects. SGLang's scheduler takes them with `take()` at each publish
(patches/0016), which returns at once. The thread starts at the first `take()`: a server without
`--kv-events-config` never calls it, and pays nothing.

Snapshots: the first poll of each source announces what its tier holds (a restart on a full store
is announced), and so does every `snapshot()` (and every `snapshot_every_s`, default 300 s, env
`SGLANG_OFFLOAD_KV_EVENTS_SNAPSHOT_S`; 0 = never) for subscribers that joined after SGLang's
replay buffer rolled over. A snapshot goes out in slices of `SNAPSHOT_SLICE` pages per poll, so
its cost per publish is bounded. Queued events are capped (`max_queued`); past it the oldest
are dropped and counted (`dropped`), and the next snapshot repairs a subscriber's view.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

from offload.events.chain import STORED, Row, events, page_rows
from offload.events.sources import Source

log = logging.getLogger(__name__)

SNAPSHOT_SLICE = 4096
LOG_EVERY_S = 60.0             # a failing source is logged at most this often
SNAPSHOT_ENV = "SGLANG_OFFLOAD_KV_EVENTS_SNAPSHOT_S"


def snapshot_every() -> float:
    try:
        return float(os.environ.get(SNAPSHOT_ENV, "300"))
    except ValueError:
        log.warning("offload events: %s=%r is not a number of seconds; using 300", SNAPSHOT_ENV,
                    os.environ.get(SNAPSHOT_ENV))
        return 300.0


class L3Events:
    def __init__(self, sources: Sequence[Source], page_size: int,
                 make_keys: Callable[[Sequence[str]], list[bytes]], split: int = 1,
                 interval_s: float = 0.5, max_queued: int = 1 << 17,
                 snapshot_every_s: float | None = None):
        self.sources = list(sources)
        self.page_size, self.split, self.interval_s = page_size, split, interval_s
        self.make_keys = make_keys
        self.snapshot_every_s = snapshot_every() if snapshot_every_s is None else snapshot_every_s
        self._inbox: collections.deque[tuple[list[str], list[bool], list[str] | None]] = \
            collections.deque()
        self._changes: collections.deque[tuple[str, str, Row]] = collections.deque()
        self.max_queued = max_queued
        self.dropped = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._snap: list[tuple[str, Row]] = []
        self._next_snapshot = float("inf")
        self._logged: dict[str, float] = {}

    # ---- data path (SGLang's storage threads) ---------------------------------------------------

    def stored(self, keys: Sequence[str], ok: Sequence[bool],
               prefix_keys: Sequence[str] | None) -> None:
        """Queue a backup call's pages (`ok`: per page stored); the thread makes the rows."""
        if self._thread is not None and any(ok):
            self._inbox.append((list(keys), list(ok),
                                list(prefix_keys[-1:]) if prefix_keys else None))

    def _rows(self) -> list[Row]:
        rows: list[Row] = []
        while self._inbox:
            keys, ok, prefix = self._inbox.popleft()
            try:
                rows += page_rows(keys, self.make_keys(keys), ok, prefix, self.split)
            except (TypeError, ValueError) as e:   # keys that are not hex page hashes
                log.debug("offload events: keys without page hashes: %s", e)
        return rows

    # ---- SGLang's scheduler thread --------------------------------------------------------------

    def take(self) -> list[Any]:
        """SGLang event objects queued since the last call (starts the thread on the first)."""
        if self._thread is None:
            self._start()
        with self._lock:
            changes = list(self._changes)
            self._changes.clear()
        return events(changes, self.page_size) if changes else []

    def snapshot(self) -> None:
        """Announce again everything the sources hold (sliced over the next polls)."""
        with self._lock:
            self._snap = [(s.medium, r) for s in self.sources for r in s.live()]

    # ---- the thread -----------------------------------------------------------------------------

    def _start(self) -> None:
        self._next_snapshot = time.monotonic() + self.snapshot_every_s if self.snapshot_every_s > 0 \
            else float("inf")
        self._thread = threading.Thread(target=self._loop, daemon=True, name="offload-kv-events")
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self.poll()
            if self._stop.wait(self.interval_s):
                self.poll()
                return

    def poll(self) -> None:
        """One round: own writes to the sources, every source's changes, a snapshot slice."""
        rows = self._rows()
        out: list[tuple[str, str, Row]] = []
        for s in self.sources:
            try:
                if rows:
                    s.wrote(rows)
                out += [(s.medium, op, r) for op, r in s.poll()]
            except Exception as e:   # a tier down or busy: its events wait for the next poll
                now = time.monotonic()
                if now - self._logged.get(s.medium, -LOG_EVERY_S) >= LOG_EVERY_S:
                    self._logged[s.medium] = now
                    log.warning("offload events: %s source: %s (logged at most every %g s)",
                                s.medium, e, LOG_EVERY_S)
        if time.monotonic() >= self._next_snapshot:
            self._next_snapshot = time.monotonic() + self.snapshot_every_s
            self.snapshot()
        with self._lock:
            snap, self._snap = self._snap[:SNAPSHOT_SLICE], self._snap[SNAPSHOT_SLICE:]
            out += [(m, STORED, r) for m, r in snap]
            self._changes.extend(out)
            over = len(self._changes) - self.max_queued
            for _ in range(max(over, 0)):
                self._changes.popleft()
            self.dropped += max(over, 0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for s in self.sources:
            try:
                s.close()
            except Exception:
                log.exception("offload events: closing the %s source", s.medium)
