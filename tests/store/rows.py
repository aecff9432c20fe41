"""Blocks of 16 KiB put and checked by id, and index rows damaged as another writer or a bit flip
could (`edit_rows`, the `HOSTILE` values): the cleanup and counter tests share them."""

from __future__ import annotations

import sqlite3

from offload.store.base import get_bytes
from tests.store.blocks import data, key

SIZE = 16 << 10


def put(s, ids, size=SIZE) -> list[bool]:
    ks = [key(i) for i in ids]
    ok = s.put_many(ks, [[data(k, size)] for k in ks])
    s.flush()
    return ok


def exact(s, ids) -> list[bool]:
    return [get_bytes(s, key(i), SIZE) == data(key(i), SIZE) for i in ids]


def edit_rows(d, updates: dict[int, tuple[str, object]]) -> None:
    """Damage index rows as another writer or a bit flip could: block id -> (column, value)."""
    db = sqlite3.connect(d / "index.db")
    with db:
        for i, (col, value) in updates.items():
            db.execute(f"UPDATE blocks SET {col}=? WHERE key=?", (value, key(i)))
    db.close()


HOSTILE = {1: ("length", 1 << 42), 2: ("length", -1), 3: ("slot", 1 << 50), 4: ("length", "abc"),
           5: ("slot_bytes", 12345), 6: ("seg", 3.5)}
