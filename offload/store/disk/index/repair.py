"""The index's defences against itself: rows read back are range-checked, damaged rows dropped, and
slots whose hole punch failed kept as tombstones until a punch succeeds. Queries only; `index.py`
calls these inside its own transactions (or opens one, `drop_bad`).

Primitives: `ROW` (the columns a `Location` is read from), `checked(row, bad)` -> a `Location` or
None (the row and why appended to `bad`), `drop_bad(db, bad)`, `retry_tombstones(db, free_slot)`
-> whether tombstones are left.
"""

from __future__ import annotations

import logging
import sqlite3
from typing import Callable, Sequence

from offload.store.disk.index.schema import MAX_OFFSET, OP_DELETE, Freed, Location, Txn, row_problem, unsigned

log = logging.getLogger(__name__)

ROW = "key, seg, slot, slot_bytes, length, csum, created"
Bad = list[tuple[tuple[object, ...], str]]


def checked(row: tuple[object, ...], bad: Bad) -> Location | None:
    """The Location of a (key, seg, slot, slot_bytes, length, csum, created) row read back, or
    None (the row and why added to `bad`) if it fails the range checks."""
    why = row_problem(*row)
    if why:
        bad.append((row, why))
        return None
    k, seg, slot, sb, length, csum, created = row
    return Location(k, seg, slot, sb, length, unsigned(csum), created)  # type: ignore[arg-type]


def drop_bad(db: sqlite3.Connection, bad: Sequence[tuple[tuple[object, ...], str]]) -> None:
    """Delete rows that failed the range checks, each exactly as it was read, in one transaction.
    Their slots are left alone (where the block really is cannot be known from a damaged row); a
    rebuild finds them again from the slab headers. The used-bytes count is recomputed. Rare
    (damage only): done in place, on whichever connection read the rows, within its busy
    timeout; a failure is logged (the rows are misses anyway and dropped next time)."""
    for row, why in bad:
        log.error("index row of block %s is damaged (%s): a miss, row dropped",
                  row[0].hex()[:16] if isinstance(row[0], bytes) else repr(row[0])[:40], why)
    try:
        with Txn(db):
            for row, _ in bad:
                cur = db.execute("DELETE FROM blocks WHERE key IS ? AND seg IS ? AND slot IS ? AND "
                                 "slot_bytes IS ? AND length IS ? AND csum IS ? AND created IS ?",
                                 row)
                if cur.rowcount and isinstance(row[0], bytes):
                    db.execute("INSERT INTO changes(key, op) VALUES(?,?)", (row[0], OP_DELETE))
            db.execute("UPDATE meta SET value=(SELECT coalesce(sum(slot_bytes), 0) FROM blocks "
                       "WHERE typeof(slot_bytes)='integer' AND slot_bytes BETWEEN 0 AND ?) "
                       "WHERE name='used'", (MAX_OFFSET,))
    except sqlite3.Error as e:
        log.warning("could not drop %d damaged index rows: %s", len(bad), e)


def retry_tombstones(db: sqlite3.Connection, free_slot: Callable[[Freed], None],
                     limit: int = 256) -> bool:
    """Punch slots kept as tombstones again (inside the caller's transaction); those that succeed
    become free slots. Returns whether tombstones are left."""
    rows = db.execute("SELECT slot_bytes, seg, slot FROM tombstones LIMIT ?", (limit,)).fetchall()
    for sb, seg, slot in rows:
        try:
            free_slot(Freed(seg, slot, sb))
        except OSError:
            return True
        db.execute("DELETE FROM tombstones WHERE slot_bytes=? AND seg=? AND slot=?", (sb, seg, slot))
        db.execute("INSERT OR IGNORE INTO free_slots VALUES(?,?,?)", (sb, seg, slot))
    return len(rows) == limit


__all__ = ["ROW", "checked", "drop_bad", "retry_tombstones"]
