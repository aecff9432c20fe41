"""Where L3 residency is learnt, per tier: each source turns its tier's changes into rows.

- `DiskSource` (medium `DISK`, the local `DiskStore`): reads the index's `changes` log (commits
  and deletions by every process sharing the directory: evictions, deletes, clears, corrupt
  drops) over its own read-only connection, and names the blocks through the directory's
  `Ledger`. Its first poll (and any poll after the log no longer reaches back, or after another
  process rebuilt the index) resynchronises from the index's committed keys: that is the
  announcement of what the directory holds after a restart.
- `SharedSource` (medium `EXTERNAL`, a tier replicas share: Redis, the agent): the replicas
  announce their pages on the tier's feed (`offload.events.feeds`: a capped Redis stream, the
  agent's ANNOUNCE / FEED) once the page is durable in the tier; each replica reads the feed from
  its start (so a new replica learns what the others stored, up to the cap) and checks every
  entry with EXISTS before announcing it. Removals (the tier's byte budget, Redis's own
  eviction, the agent's, a delete by anyone) are found by a sweep: each poll checks the next
  `sweep` announced pages.
- `SweepSource`: the sweep alone, over pages this process stored (the base of `SharedSource`).

A source's `poll()` returns (op, row) changes; `live()` what it holds announced. Sources run on
the events thread only (`offload.events.tracker`); every tier call is bounded per poll.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from typing import Any, Sequence

from offload.events.chain import REMOVED, STORED, Row
from offload.events.feeds import PER_POLL, Feed
from offload.events.ledger import Ledger

log = logging.getLogger(__name__)

DISK, EXTERNAL = "DISK", "EXTERNAL"
CHANGES_PER_POLL = 20_000      # the index's change-log rows read per poll
PENDING_POLLS = 40             # polls a committed block waits for its ledger row
UPLOAD_WAIT_S = 120.0          # how long a page written here may take to be durable in a shared tier
_OP_COMMIT = 1                 # offload.store.disk.index.schema.OP_COMMIT


class Source:
    medium = EXTERNAL

    def __init__(self) -> None:
        self._live: dict[bytes, Row] = {}

    def wrote(self, rows: Sequence[Row]) -> None:
        """Pages this process stored (put returned success)."""

    def poll(self) -> list[tuple[str, Row]]:
        return []

    def live(self) -> list[Row]:
        return list(self._live.values())

    def close(self) -> None:
        pass


class SweepSource(Source):
    """Own stores are announced at once; removals found by checking `sweep` pages a poll."""

    def __init__(self, store: Any, medium: str = EXTERNAL, sweep: int = 512):
        super().__init__()
        self.store, self.medium, self.sweep = store, medium, sweep
        self._out: list[tuple[str, Row]] = []
        self._cursor: list[bytes] = []

    def wrote(self, rows: Sequence[Row]) -> None:
        for r in rows:
            if r.key not in self._live:
                self._out.append((STORED, r))
            self._live[r.key] = r

    def _sweep(self) -> list[tuple[str, Row]]:
        if not self._cursor:
            self._cursor = list(self._live)
        batch, self._cursor = self._cursor[:self.sweep], self._cursor[self.sweep:]
        batch = [k for k in batch if k in self._live]
        if not batch:
            return []
        present = self.store.exists_many(batch)
        out = []
        for k, here in zip(batch, present):
            if not here:
                out.append((REMOVED, self._live.pop(k)))
        return out

    def poll(self) -> list[tuple[str, Row]]:
        out, self._out = self._out, []
        return out + self._sweep()


class SharedSource(SweepSource):
    """A tier replicas share (Redis, the agent): pages announced on its feed once durable there,
    read back by every replica and checked with EXISTS; removals by sweep."""

    def __init__(self, store: Any, feed: Feed, sweep: int = 512, clock: Any = time.monotonic):
        super().__init__(store, EXTERNAL, sweep)
        self.feed = feed
        self._uploading: dict[bytes, tuple[Row, float]] = {}
        self._clock = clock

    def wrote(self, rows: Sequence[Row]) -> None:
        deadline = self._clock() + UPLOAD_WAIT_S
        for r in rows:
            self._uploading[r.key] = (r, deadline)

    def _announce_uploaded(self) -> None:
        """Publish the pages written here that the tier now holds (durably)."""
        if not self._uploading:
            return
        keys = list(self._uploading)[:PER_POLL]
        present = self.store.exists_many(keys)
        done = [self._uploading[k][0] for k, here in zip(keys, present) if here]
        published: set[bytes] = set()
        if done:
            published = {r.key for r, ok in zip(done, self.feed.publish(done)) if ok}
        now = self._clock()
        for k in keys:
            if k in published or now > self._uploading[k][1]:
                del self._uploading[k]

    def _read_feed(self) -> list[tuple[str, Row]]:
        fresh = [r for r in self.feed.read() if r.key not in self._live]
        if not fresh:
            return []
        present = self.store.exists_many([r.key for r in fresh])
        out = []
        for r, here in zip(fresh, present):
            if here and r.key not in self._live:
                self._live[r.key] = r
                out.append((STORED, r))
        return out

    def poll(self) -> list[tuple[str, Row]]:
        self._announce_uploaded()
        return self._read_feed() + self._sweep()

    def close(self) -> None:
        self.feed.close()


class DiskSource(Source):
    """The local directory: the index's change log, named through the ledger."""

    medium = DISK

    def __init__(self, directory: str, digest: bytes, index_name: str = "index.db",
                 replay_limit: int = 1 << 20):
        super().__init__()
        self.directory, self.digest = directory, digest
        self.index_path = os.path.join(directory, index_name)
        self.ledger = Ledger(directory)
        self.replay_limit = replay_limit
        self._db: sqlite3.Connection | None = None
        self._ino: int | None = None
        self._seq = -1
        self._pending: dict[bytes, int] = {}

    def wrote(self, rows: Sequence[Row]) -> None:
        self.ledger.put([r for r in rows if r.key[:len(self.digest)] == self.digest])

    def _conn(self) -> sqlite3.Connection:
        ino = os.stat(self.index_path).st_ino
        if self._db is None or ino != self._ino:   # first poll, or the index was rebuilt
            if self._db is not None:
                self._db.close()
            self._db = sqlite3.connect(f"file:{self.index_path}?mode=ro", uri=True, timeout=2.0,
                                       check_same_thread=False)
            self._ino, self._seq = ino, -1
        return self._db

    def _ours(self, key: bytes) -> bool:
        return key[:len(self.digest)] == self.digest

    def _resync(self, db: sqlite3.Connection) -> list[tuple[str, Row]]:
        """Everything the directory holds in our namespace, against what was announced."""
        ledger_keys = self.ledger.keys(self.digest)      # first: see ledger.py on the order
        lo, hi = self.digest + b"\x00" * 16, self.digest + b"\xff" * 16
        seq = db.execute("SELECT coalesce(max(seq), 0) FROM changes").fetchone()[0]
        held = {bytes(k) for (k,) in db.execute(
            "SELECT key FROM blocks WHERE key BETWEEN ? AND ? AND state=1 LIMIT ?",
            (lo, hi, self.replay_limit))}
        self._seq = seq
        self.ledger.forget([k for k in ledger_keys if k not in held])
        out = [(REMOVED, self._live.pop(k)) for k in list(self._live) if k not in held]
        named = self.ledger.get(k for k in held if k not in self._live)
        for k in held:
            if k in self._live:
                continue
            if k in named:
                self._live[k] = named[k]
                out.append((STORED, named[k]))
            else:
                self._pending[k] = PENDING_POLLS
        return out

    def poll(self) -> list[tuple[str, Row]]:
        db = self._conn()
        if self._seq < 0:
            return self._resync(db)
        rows = db.execute("SELECT seq, key, op FROM changes WHERE seq > ? ORDER BY seq LIMIT ?",
                          (self._seq, CHANGES_PER_POLL)).fetchall()
        if rows and rows[0][0] != self._seq + 1:
            first = db.execute("SELECT min(seq) FROM changes").fetchone()[0]
            if first is None or first > self._seq + 1:     # the log was trimmed past us
                return self._resync(db)
        out: list[tuple[str, Row]] = []
        for seq, key, op in rows:
            self._seq = seq
            key = bytes(key)
            if not self._ours(key):
                continue
            if op == _OP_COMMIT:
                self._pending[key] = PENDING_POLLS
                continue
            self._pending.pop(key, None)
            row = self._live.pop(key, None)
            if row is not None:
                out.append((REMOVED, row))
        return out + self._name_pending()

    def _name_pending(self) -> list[tuple[str, Row]]:
        if not self._pending:
            return []
        named = self.ledger.get(self._pending)
        out = []
        for k in list(self._pending):
            row = named.get(k)
            if row is not None:
                del self._pending[k]
                if k not in self._live:
                    self._live[k] = row
                    out.append((STORED, row))
                continue
            self._pending[k] -= 1
            if self._pending[k] <= 0:       # stored by something that keeps no ledger
                del self._pending[k]
        return out

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
        self.ledger.close()
