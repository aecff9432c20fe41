"""Subprocess worker for the full-disk test (`tests/store/test_disk_full.py`), run with the ENOSPC
shim preloaded (`enospc.c`): `python enospc_worker.py SHIM DIR FIRST LAST COUNT`.

For each n in FIRST..LAST: a fresh store in DIR/<n> runs the same put path (batches of two sizes,
`flush()` after each, a delete so slots are freed and reused, evictions under a small cap), with
the n-th call that can need disk space -- a slab write, a sync, a hole punch, SQLite's log or
database write -- and the COUNT - 1 after it failing with ENOSPC. Then the shim is disarmed, the
store closed, and a new store on the directory reads back every block `flush()` called durable
(put True, then flush True): each must be there, byte-exact, unless the change log records that
the store deleted or evicted it. Prints one JSON line per n: {"n", "calls", "acked", "lost",
"wrong"} (no pickle)."""

from __future__ import annotations

import ctypes
import json
import os
import sqlite3
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from offload.config import Size, StoreConfig  # noqa: E402
from offload.store.disk.store import DiskStore  # noqa: E402
from tests.store.blocks import data, key  # noqa: E402

SIZES = (64 << 10, 16 << 10)


def open_store(d: str) -> DiskStore:
    return DiskStore(StoreConfig(path=d, capacity=Size(1 << 20), min_free=Size(0),
                                 segment_size=Size(512 << 10), io_threads=2))


def scenario(store: DiskStore) -> dict[int, int]:
    """The put path, with deletes and evictions: the blocks flush() called durable -> size."""
    acked: dict[int, int] = {}
    i = 0
    for rnd in range(8):
        size = SIZES[rnd % 2]
        ids = list(range(i, i + 4))
        i += 4
        ks = [key(j) for j in ids]
        ok = store.put_many(ks, [[data(k, size)] for k in ks])
        if store.flush(30):
            acked.update((j, size) for j, o in zip(ids, ok) if o)
        if rnd == 3:   # slots freed, then reused by the next puts
            store.delete_many([key(j) for j in ids[:2]])
            for j in ids[:2]:
                acked.pop(j, None)
    return acked


def deleted(d: str) -> set[bytes]:
    db = sqlite3.connect(f"file:{d}/index.db?mode=ro", uri=True)
    try:
        return {bytes(k) for (k,) in db.execute("SELECT key FROM changes WHERE op=2")}
    finally:
        db.close()


def main() -> None:
    shim = ctypes.CDLL(sys.argv[1])
    root, first, last, count = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    for n in range(first, last + 1):
        d = os.path.join(root, str(n))
        store = open_store(d)
        shim.enospc_arm(d.encode() + b"/", ctypes.c_long(n), ctypes.c_long(count))
        try:
            acked = scenario(store)
        finally:
            calls = shim.enospc_calls()
            shim.enospc_arm(b"", ctypes.c_long(0), ctypes.c_long(0))
        store.close()
        gone = deleted(d)
        lost, wrong = [], []
        with open_store(d) as s:
            for j, size in sorted(acked.items()):
                buf = bytearray(size)
                if not s.get_many([key(j)], [[buf]])[0]:
                    if key(j) not in gone:
                        lost.append(j)
                elif bytes(buf) != data(key(j), size):
                    wrong.append(j)
        print(json.dumps({"n": n, "calls": calls, "acked": len(acked), "lost": lost,
                          "wrong": wrong}), flush=True)


if __name__ == "__main__":
    main()
