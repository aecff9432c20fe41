"""The events ledger of a cache directory: which SGLang block hash each stored block holds.

The store's index knows blocks by their 32-byte key, a one-way digest of SGLang's page hash, so
it cannot say which hash an evicted block had. The ledger (`kv-events.db`, SQLite in WAL mode,
next to the index, mode 0600) keeps `key -> (hash, parent)` for every page a backend stored in
the directory, written by that backend's events thread after the page is durable. Every process
sharing the directory reads it to name the blocks the index's change log reports committed or
deleted, and a restarted server reads it to announce what the directory holds. It is bookkeeping
for events only: losing it loses events, never a block. Rows of blocks the index no longer holds
are pruned when a process resynchronises: it reads the ledger's keys first, then the
index's, and forgets the difference (a row is written after its block's commit, so a block
committed meanwhile is in the index read).
"""

from __future__ import annotations

import os
import sqlite3
from typing import Iterable, Sequence

from offload.events.chain import Row

LEDGER_NAME = "kv-events.db"
_MAX_VARS = 500

_SCHEMA = """
CREATE TABLE IF NOT EXISTS pages(key BLOB PRIMARY KEY, hash INTEGER NOT NULL, parent INTEGER)
  WITHOUT ROWID;
"""


class Ledger:
    """One connection, used by one events thread."""

    def __init__(self, directory: str, timeout_s: float = 5.0):
        self.path = os.path.join(directory, LEDGER_NAME)
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        os.close(fd)
        self.db = sqlite3.connect(self.path, timeout=timeout_s, isolation_level=None,
                                  check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)

    def put(self, rows: Sequence[Row]) -> None:
        if not rows:
            return
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.executemany("INSERT OR REPLACE INTO pages(key, hash, parent) VALUES(?,?,?)",
                                [(r.key, r.hash, r.parent) for r in rows])
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def get(self, keys: Iterable[bytes]) -> dict[bytes, Row]:
        keys = list(keys)
        out: dict[bytes, Row] = {}
        for i in range(0, len(keys), _MAX_VARS):
            chunk = keys[i:i + _MAX_VARS]
            for k, h, p in self.db.execute(
                    f"SELECT key, hash, parent FROM pages WHERE key IN ({','.join('?' * len(chunk))})",
                    chunk):
                out[bytes(k)] = Row(bytes(k), int(h), None if p is None else int(p))
        return out

    def keys(self, prefix: bytes) -> list[bytes]:
        """Every key under namespace `prefix`."""
        lo, hi = prefix + b"\x00" * 16, prefix + b"\xff" * 16
        return [bytes(k) for (k,) in self.db.execute(
            "SELECT key FROM pages WHERE key BETWEEN ? AND ?", (lo, hi))]

    def forget(self, keys: Sequence[bytes]) -> None:
        for i in range(0, len(keys), _MAX_VARS):
            chunk = list(keys[i:i + _MAX_VARS])
            self.db.execute(f"DELETE FROM pages WHERE key IN ({','.join('?' * len(chunk))})", chunk)

    def close(self) -> None:
        self.db.close()
