"""A field of the wrong type in the index is damage, never an exception (issue 36, round 3).

SQLite keeps any type in any column: a damaged page (or another program) can leave a text where
the store reads an integer. Before, a text in one `reserved` row made every open of the directory
raise `ValueError` (the store could not start; `cache stats/verify/evict` said "internal error"),
a missing or text `used` failed every put for good, and a description that is not JSON broke
`cache stats`. Now `Index.check_and_init` (`schema.type_problem`) finds every such field of every
table read without a per-row check: the index is damaged, set aside and rebuilt from the slab
headers (what a damaged index gets). Walked over each table and field, on real files, through
the data path and through the `cache` command (one subcommand per case, in turn)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import pytest

from offload.store.base import get_bytes
from tests.store.blocks import data, key
from tests.store.stores import open_store

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZE = 16 << 10
N = 4

DAMAGE = [   # one statement per table and field the store reads back without a per-row check
    "INSERT INTO reserved VALUES(20480, 'x', 3, 'lease:0')",
    "INSERT INTO reserved VALUES('a', 0, 3, 'lease:0')",
    "INSERT INTO reserved VALUES(20480, 0, 3, x'00')",
    "INSERT INTO free_slots VALUES(20480, 0, 'z')",
    "INSERT INTO tombstones VALUES('z', 0, 9)",
    "UPDATE segments SET next_slot='q'",
    "UPDATE segments SET slot_bytes=x'00'",
    "UPDATE blocks SET seg='x', state=0 WHERE key=(SELECT min(key) FROM blocks)",
    "UPDATE meta SET value='abc' WHERE name='used'",
    "UPDATE meta SET value=1.5 WHERE name='capacity'",
    "DELETE FROM meta WHERE name='used'",
    "INSERT INTO namespaces VALUES(x'00', 'not json')",
    "INSERT INTO namespaces VALUES(x'01', 12)",        # (stored as the text '12')
    "INSERT INTO namespaces VALUES(x'02', '[1, 2]')",
]


def _damaged(d, sql: str) -> None:
    with open_store(d, capacity=1 << 20) as s:
        ks = [key(i) for i in range(N)]
        assert s.put_many(ks, [[data(k, SIZE)] for k in ks]) == [True] * N
        assert s.flush(60)
    db = sqlite3.connect(d / "index.db")
    try:
        db.execute(sql)
        db.commit()
    finally:
        db.close()


@pytest.mark.parametrize("sql", DAMAGE)
def test_a_field_of_the_wrong_type_is_a_damaged_index_for_the_data_path(tmp_path, sql):
    d = tmp_path / "cache"
    _damaged(d, sql)
    with open_store(d, capacity=1 << 20) as s:   # before: ValueError, or every put failing
        assert s.rebuilt_from is not None
        # a block whose pending row was damaged is not one flush() called durable any more
        # (the test made it so): the others are all there, byte-exact
        got = [get_bytes(s, key(i), SIZE) for i in range(N)]
        assert sum(g == data(key(i), SIZE) for i, g in enumerate(got)) >= N - 1
        assert all(g is None or g == data(key(i), SIZE) for i, g in enumerate(got))
        ks = [key(100 + i) for i in range(N)]
        assert s.put_many(ks, [[data(k, SIZE)] for k in ks]) == [True] * N
        assert s.flush(60)


@pytest.mark.parametrize("i", range(len(DAMAGE)))
def test_a_field_of_the_wrong_type_is_never_a_traceback_of_cache_commands(tmp_path, i):
    d = tmp_path / "cache"
    _damaged(d, DAMAGE[i])
    cmd = (["stats"], ["verify"], ["evict", "--to", "1MiB"])[i % 3]
    r = subprocess.run([sys.executable, "-m", "offload.cli", "cache", *cmd, str(d)],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr, r.stderr
