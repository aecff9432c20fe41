"""The disk index's schema, row types and transactions (used by `index.py`; no queries here).

Tables: `blocks` (key -> segment, slot, length, checksum, state, last use), `segments` (slot size and
fill of each slab file), `free_slots`, `changes` (an append-only log of commits and deletions),
`meta` (schema version, capacity, bytes used) and `namespaces`. A checksum is an unsigned 64-bit
value stored as SQLite's signed integer (`signed` / `unsigned`).

Primitives: `SCHEMA`, the states `PENDING` / `COMMITTED`, the change ops, `Location` (where a block
is), `Freed` (a slot given back), `Allocation` (what `Index.allocate` did), `Txn` (BEGIN IMMEDIATE
.. COMMIT, or ROLLBACK on an exception; `durable=False` commits without syncing the log).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

SCHEMA_VERSION = 1
PENDING, COMMITTED = 0, 1
OP_COMMIT, OP_DELETE = 1, 2
CHANGES_KEPT = 200_000
MAX_VARS = 900
SIDE_FILES = ("-wal", "-shm")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(name TEXT PRIMARY KEY, value) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS blocks(
  key BLOB PRIMARY KEY, seg INTEGER NOT NULL, slot INTEGER NOT NULL, length INTEGER NOT NULL,
  slot_bytes INTEGER NOT NULL, csum INTEGER NOT NULL, state INTEGER NOT NULL, owner TEXT,
  created REAL NOT NULL, atime REAL NOT NULL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS blocks_lru ON blocks(state, atime);
CREATE TABLE IF NOT EXISTS segments(seg INTEGER PRIMARY KEY, slot_bytes INTEGER NOT NULL,
  nslots INTEGER NOT NULL, next_slot INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS segments_size ON segments(slot_bytes, next_slot);
CREATE TABLE IF NOT EXISTS free_slots(slot_bytes INTEGER NOT NULL, seg INTEGER NOT NULL,
  slot INTEGER NOT NULL, PRIMARY KEY(slot_bytes, seg, slot)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS changes(seq INTEGER PRIMARY KEY AUTOINCREMENT, key BLOB NOT NULL,
  op INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS namespaces(digest BLOB PRIMARY KEY, description TEXT NOT NULL)
  WITHOUT ROWID;
"""


def signed(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


def unsigned(s: int) -> int:
    return s + (1 << 64) if s < 0 else s


@dataclass(frozen=True)
class Location:
    key: bytes
    seg: int
    slot: int
    slot_bytes: int
    length: int
    csum: int


@dataclass(frozen=True)
class Freed:
    seg: int
    slot: int
    slot_bytes: int


@dataclass
class Allocation:
    new: list[Location]          # slots to write
    present: list[bytes]         # already committed: nothing to do
    skipped: dict[bytes, str]    # key -> why not stored (busy, full)
    freed: list[Freed]           # evicted slots (already hole-punched by the caller's callback)
    evicted: int


class Txn:
    def __init__(self, db: sqlite3.Connection, write: bool = True, durable: bool = True):
        self.db, self.write, self.durable = db, write, durable

    def __enter__(self) -> "Txn":
        if not self.durable:
            self.db.execute("PRAGMA synchronous=NORMAL")  # WAL: the commit is not synced
        try:
            self.db.execute("BEGIN IMMEDIATE" if self.write else "BEGIN")
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        try:
            self.db.execute("COMMIT" if exc_type is None else "ROLLBACK")
        finally:
            self._restore()

    def _restore(self) -> None:
        if not self.durable:
            self.db.execute("PRAGMA synchronous=FULL")
