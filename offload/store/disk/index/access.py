"""The disk store's two connections to its index, and how long the data path may wait on them.

`IndexAccess(open_writer)` holds:
- `writer`: the `Index` every write transaction goes through (reserve, commit, delete, touch),
  used only under `wlock`, through `write(fn)`;
- `reader`: a second connection to the same file for reads (locate, the change log, usage), used
  under the store's own state lock. In WAL mode a read never waits for a writer, so gets and
  exists go on while a put or the committer waits for another process's transaction.

`write(fn)` on the data path waits at most `DATA_LOCK_TIMEOUT_S` for `wlock` and as long again
for SQLite's lock (busy_timeout), then returns `BUSY` (counted in `busy`): the caller misses or
skips the write. `write(fn, control=True)` (cache clear, evict, namespaces) waits up to
`LOCK_TIMEOUT_S` and raises `StoreError` past it. `replaced()` says another process set the index
aside and rebuilt it (an older version's rebuild, or a file moved by hand: this version refuses
to rebuild beside a live process, `recovery.py`); `write` then raises `IndexReplaced` rather than
write into the set-aside file, and `reopen()` opens both connections again.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from typing import Callable, TypeVar

from offload.errors import StoreError
from offload.store.disk.index.db import Index

LOCK_TIMEOUT_S = 60.0       # opening, the control path: long enough for another process's rebuild
DATA_LOCK_TIMEOUT_S = 0.5   # the data path: then a miss or a skipped write, never a stalled server


class Busy:
    """The `write` result when the index stayed locked past the deadline."""

    def __repr__(self) -> str:
        return "BUSY"


BUSY = Busy()
T = TypeVar("T")


class IndexReplaced(StoreError):
    """The index file this process has open was set aside and replaced by another process (a
    rebuild): a write to it would go into the set-aside file and be lost."""


def is_busy(e: sqlite3.Error) -> bool:
    """SQLite's 'database is locked' / 'database table is locked' (another connection)."""
    return isinstance(e, sqlite3.OperationalError) and "locked" in str(e)


class IndexAccess:
    def __init__(self, open_writer: Callable[[float], Index], timeout_s: float):
        self._open_writer = open_writer
        self.wlock = threading.Lock()
        self.busy = 0
        self._bad_before = 0   # damaged rows seen by connections closed since (a reopen)
        self.writer, self.reader = self._open(timeout_s)

    def _open(self, timeout_s: float) -> tuple[Index, Index]:
        writer = self._open_writer(timeout_s)
        try:
            reader = Index(writer.path)
            if reader.ino != writer.ino:   # replaced again in between: the next call reopens
                raise sqlite3.OperationalError("index replaced while opening: locked")
        except BaseException:
            writer.close()
            raise
        for ix in (writer, reader):
            ix.set_busy_timeout(DATA_LOCK_TIMEOUT_S)
        return writer, reader

    def replaced(self) -> bool:
        try:
            ino = os.stat(self.writer.path).st_ino
        except OSError:
            ino = -1
        return ino != self.reader.ino or ino != self.writer.ino

    def reopen(self, state_lock: threading.RLock) -> bool:
        """Open both connections again (another process rebuilt the index). False if busy."""
        if not self.wlock.acquire(timeout=DATA_LOCK_TIMEOUT_S):
            self.busy += 1
            return False
        try:
            with state_lock:
                if not self.replaced():
                    return True
                writer, reader = self._open(DATA_LOCK_TIMEOUT_S)  # StoreError: the caller misses
                self._bad_before = self.bad_rows
                self.writer.close()
                self.reader.close()
                self.writer, self.reader = writer, reader
                return True
        finally:
            self.wlock.release()

    @property
    def bad_rows(self) -> int:
        """Index rows that failed the range checks since this store opened (each dropped)."""
        return self._bad_before + self.writer.bad_rows + self.reader.bad_rows

    def write(self, fn: Callable[[Index], T], control: bool = False,
              wait: float = DATA_LOCK_TIMEOUT_S) -> T | Busy:
        """fn(writer) under `wlock` (see the module docstring); BUSY past the deadline."""
        deadline = LOCK_TIMEOUT_S if control else wait
        if not self.wlock.acquire(timeout=deadline):
            if not deadline:   # an opportunistic write (last use times): not a busy index
                return BUSY
            return self._busy(control, "another thread of this process")
        try:
            if self.replaced():   # never write into a set-aside index (`IndexReplaced`)
                raise IndexReplaced(f"the index {self.writer.path} was replaced by another "
                                    "process (rebuilt) since this process opened it")
            if control:
                self.writer.set_busy_timeout(LOCK_TIMEOUT_S)
            try:
                return fn(self.writer)
            except sqlite3.OperationalError as e:
                if not is_busy(e):
                    raise
                return self._busy(control, "another process")
            finally:
                if control:
                    self.writer.set_busy_timeout(DATA_LOCK_TIMEOUT_S)
        finally:
            self.wlock.release()

    def _busy(self, control: bool, holder: str) -> Busy:
        if control:
            raise StoreError(f"the store index stayed locked by {holder} for {LOCK_TIMEOUT_S:.0f} "
                             "s; retry when it is done (e.g. a running `cache clear`)")
        self.busy += 1
        return BUSY

    def close(self) -> None:
        with self.wlock:
            self.writer.close()
            self.reader.close()


__all__ = ["BUSY", "DATA_LOCK_TIMEOUT_S", "LOCK_TIMEOUT_S", "Busy", "IndexAccess", "IndexReplaced",
           "is_busy"]
