"""Processes sharing one cache directory (tests/store/procs.py as workers), and how a test reads
what they leave: `proc`, `line`, `durable_blocks`, `lost`, `cache_stats` (the `cache stats`
command), `damage_a_page_nobody_writes` (an index page no writer touches)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.store.blocks import data, key
from tests.store.stores import open_store

ROOT = str(Path(__file__).resolve().parents[2])


PROCS = os.path.join(os.path.dirname(__file__), "procs.py")


SIZE = 64 << 10


ENV = dict(os.environ, PYTHONPATH=ROOT)


def proc(mode: str, d, prefix: tuple[str, ...] = (), stdin: bool = False,
         **opts: object) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, PROCS, mode, str(d), json.dumps(opts)],
                            stdout=subprocess.PIPE, stdin=subprocess.PIPE if stdin else None,
                            text=True, env=ENV)


def line(p: subprocess.Popen) -> dict:
    text = p.stdout.readline()   # type: ignore[union-attr]
    assert text, f"worker ended (rc {p.poll()})"
    return json.loads(text)


def cache_stats(d) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "offload.cli", "cache", "stats", str(d), "--json"],
                          capture_output=True, text=True, env=ENV, timeout=300)


def durable_blocks(p: subprocess.Popen) -> list[int]:
    """Blocks a `stream` worker was told are stored and durable (put True, then flush True)."""
    out = []
    for text in p.stdout:   # type: ignore[union-attr]
        rec = json.loads(text)
        if rec["flushed"]:
            out += [rec["from"] + j for j, ok in enumerate(rec["ok"]) if ok]
    return out


def lost(d, ids: list[int]) -> list[int]:
    with open_store(d) as s:
        got = []
        for i in ids:
            buf = bytearray(SIZE)
            ok = s.get_many([key(i)], [[buf]])[0]
            assert not ok or bytes(buf) == data(key(i), SIZE), f"block {i} reads back wrong"
            if not ok:
                got.append(i)
    return got


def damage_a_page_nobody_writes(d) -> None:
    """Fill the namespaces table (pages nobody writes while blocks come and go), checkpoint, and
    overwrite one of its pages in index.db: `PRAGMA quick_check` fails, the writers do not."""
    db = sqlite3.connect(d / "index.db")
    try:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        before = db.execute("PRAGMA page_count").fetchone()[0]
        db.executemany("INSERT INTO namespaces VALUES(?,?)",
                       ((os.urandom(16), "x" * 2000) for _ in range(40)))
        db.commit()
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page = db.execute("PRAGMA page_size").fetchone()[0]
        after = db.execute("PRAGMA page_count").fetchone()[0]
    finally:
        db.close()
    assert after > before + 2
    with open(d / "index.db", "r+b") as f:
        f.seek((before + 1) * page)   # a leaf of the namespaces table
        f.write(os.urandom(page))
