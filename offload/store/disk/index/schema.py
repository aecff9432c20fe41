"""The disk index's schema, row types and transactions (used by `index.py`; no queries here).

Tables: `blocks` (key -> segment, slot, length, checksum, state, last use), `segments` (slot size and
fill of each slab file), `free_slots`, `reserved` (slots held by a live process for its next puts,
counted in `used`; `disk/index/alloc.py`), `changes` (an append-only log of commits and deletions),
`meta` (schema version, capacity, bytes used) and `namespaces`. A checksum is an unsigned 64-bit
value stored as SQLite's signed integer (`signed` / `unsigned`).

Primitives: `SCHEMA`, the states `PENDING` / `COMMITTED`, the change ops, `Location` (where a block
is; `created` is the row's generation, so a cleanup deletes only the row it read), `Freed` (a slot
given back), `Allocation` (what `Index.allocate` did), `Reserved` (what `Index.reserve` did),
`Txn` (BEGIN IMMEDIATE .. COMMIT, or ROLLBACK on an exception; `durable=False` commits without
syncing the log), `read_only` (the rows of one query on an index opened read-only, never created),
`row_problem` (the range checks every row read back passes before it addresses a slab).

`tombstones` holds freed slots whose hole punch (or header zeroing) failed: their header may still
name the deleted block, so they are never handed out and a rebuild does not bring them back; the
punch is retried.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import TypeGuard

from offload.keys import KEY_BYTES
from offload.store.disk.location import HEADER_BYTES, Location, slot_bytes_for

SCHEMA_VERSION = 1
PENDING, COMMITTED = 0, 1
OP_COMMIT, OP_DELETE = 1, 2
# `reserved` rows owned by PUNCH + a lease token: written by one earlier build for the slots of
# blocks deleted by a committed transaction, held until punched, not counted in `used`. An older
# version judged such an owner dead at once (not a lease token) and reclaimed it while its process
# lived, subtracting bytes never counted: holds are now owned by the plain lease token and counted
# (`Index.recycle`); rows of the old form are still reclaimed as not counted.
PUNCH = "punch:"
COUNTED = "owner NOT LIKE 'punch:%'"   # the `reserved` rows counted in `used`
CHANGES_KEPT = 200_000
MAX_VARS = 900
SIDE_FILES = ("-wal", "-shm")
MAX_SEG = 1 << 40          # segment ids, slot numbers and lengths beyond these are damage
MAX_LENGTH = 1 << 40
MAX_OFFSET = 1 << 62       # a slot's end must stay a valid file offset

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
CREATE TABLE IF NOT EXISTS tombstones(slot_bytes INTEGER NOT NULL, seg INTEGER NOT NULL,
  slot INTEGER NOT NULL, PRIMARY KEY(slot_bytes, seg, slot)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS reserved(slot_bytes INTEGER NOT NULL, seg INTEGER NOT NULL,
  slot INTEGER NOT NULL, owner TEXT NOT NULL, PRIMARY KEY(slot_bytes, seg, slot)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS reserved_owner ON reserved(owner);
CREATE TABLE IF NOT EXISTS namespaces(digest BLOB PRIMARY KEY, description TEXT NOT NULL)
  WITHOUT ROWID;
"""


# Every field the store reads back without a per-row check (its slot arithmetic, the cap, the
# namespaces' descriptions): SQLite keeps any type in any column, so a damaged page or another
# program can leave a text where an integer belongs, and then an open, a reclaim, a put or
# `cache stats` would raise. `type_problem` finds them: the index is damaged (set aside, rebuilt).
# The blocks' committed rows are checked per row where they are read (`row_problem`).
_INT = "typeof({}) != 'integer'"
_TYPED = (
    ("reserved", ("slot_bytes", "seg", "slot"), "typeof(owner) != 'text'"),
    ("free_slots", ("slot_bytes", "seg", "slot"), ""),
    ("tombstones", ("slot_bytes", "seg", "slot"), ""),
    ("segments", ("seg", "slot_bytes", "nslots", "next_slot"), ""),
    ("blocks", (), "(state = 0 AND (" + " OR ".join(
        _INT.format(c) for c in ("seg", "slot", "slot_bytes")) + "))"),
    ("meta", (), "name IN ('used', 'capacity') AND typeof(value) != 'integer'"),
    ("namespaces", (), "typeof(description) != 'text' OR CASE WHEN json_valid(description) "
                       "THEN json_type(description) != 'object' ELSE 1 END"),
)


def type_problem(db: sqlite3.Connection) -> str:
    """'' if every field read without a per-row check has its type, else what is wrong."""
    for table, ints, extra in _TYPED:
        cond = " OR ".join([_INT.format(c) for c in ints] + ([extra] if extra else []))
        (n,) = db.execute(f"SELECT count(*) FROM {table} WHERE {cond}").fetchone()
        if n:
            return f"{n} rows of {table} with a field of the wrong type"
    have = {r[0] for r in db.execute("SELECT name FROM meta WHERE name IN ('used', 'capacity')")}
    if len(have) < 2:
        return f"meta misses {', '.join(sorted({'used', 'capacity'} - have))}"
    return ""


def read_only(path: str, sql: str, *, timeout: float) -> list[tuple]:
    """The rows of `sql` on the index at `path`, opened read-only (never created). Raises
    sqlite3.Error."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout)
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


def signed(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


def unsigned(s: int) -> int:
    return s + (1 << 64) if s < 0 else s


def _is_int(v: object, lo: int, hi: int) -> TypeGuard[int]:
    return type(v) is int and lo <= v <= hi


def row_problem(key: object, seg: object, slot: object, slot_bytes: object, length: object,
                csum: object, created: object = 0.0) -> str:
    """'' if a row read back from the index can address a slot, else what is wrong with it.

    SQLite stores any type in any column: every field is checked for its type and range, the
    slot size against the length (its size class) and the slot's end against the largest offset.
    """
    if type(key) is not bytes or len(key) != KEY_BYTES:
        return "bad key"
    if not _is_int(length, 0, MAX_LENGTH):
        return f"length {length!r} out of range"
    if not _is_int(slot_bytes, HEADER_BYTES, MAX_OFFSET) or slot_bytes != slot_bytes_for(length):
        return f"slot size {slot_bytes!r} is not the size class of length {length}"
    if not _is_int(seg, 0, MAX_SEG) or not _is_int(slot, 0, MAX_SEG):
        return f"segment {seg!r} / slot {slot!r} out of range"
    if (slot + 1) * slot_bytes > MAX_OFFSET:
        return f"slot {slot} ends past the largest file offset"
    if not _is_int(csum, -(1 << 63), (1 << 63) - 1) or type(created) not in (int, float):
        return "bad checksum or creation time"
    return ""


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


@dataclass
class Reserved:
    slots: dict[int, list[tuple[int, int]]]   # slot_bytes -> (seg, slot) now held by the process
    short: dict[int, str]        # slot_bytes -> why fewer slots than needed (full)
    evicted: int
    freed: list[Freed]           # evicted slots (already hole-punched by the caller's callback)
    offer_taken: bool = False    # the range offered back was given back (else the caller's still)


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
            try:
                self.db.execute("COMMIT" if exc_type is None else "ROLLBACK")
            except sqlite3.Error:
                if self.db.in_transaction:   # a COMMIT that failed (disk full) and left it open
                    self.db.execute("ROLLBACK")
                raise
        finally:
            self._restore()

    def _restore(self) -> None:
        if not self.durable:
            self.db.execute("PRAGMA synchronous=FULL")
