"""Subprocess worker for the many-process disk-store tests: `python procs.py MODE DIR JSON` (no pickle).

Modes (each prints JSON lines on stdout, flushed):
- `stream`: put blocks `start`, `start+1`, ... in batches, `flush()` after each batch, print
  {"from", "ok": [put flags], "flushed": flush()} per batch, until the file `stop` exists (or
  `stop_after` blocks), then close.
- `hold`: register a namespace, put blocks 0..n-1, flush, take SQLite's write lock on the store's
  own writer connection, print {"locked": true}, then wait for a line on stdin: roll back, print
  {"released": true}, wait for another line, close.
- `churn`: for `seconds`, delete blocks 0..n-1 and put them again (in turn forwards and backwards,
  so their slots change hands), flush; print {"rounds"}.
- `reader`: for `seconds`, get blocks 0..n-1; print {"hits", "misses", "wrong", "checksum_failures",
  "reused_reads"}.
- `sizes`: put one block of each size in `sizes` (bytes; key `first + i`), flush, print
  {"ok", "flushed"}, wait until the file `stop` exists, close.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from offload.keys import Namespace  # noqa: E402
from tests.store.blocks import data, key  # noqa: E402
from tests.store.worker import open_from_argv  # noqa: E402


def out(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def wait_for(path: str, limit: float = 300.0) -> None:
    end = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.02)


def main() -> None:
    mode, directory, o, store = open_from_argv(threads=2)
    size = o.get("size", 65536)
    if mode == "stream":
        i, batch, stop = o.get("start", 0), o.get("batch", 4), o.get("stop", "")
        while not (stop and os.path.exists(stop)) and i < o.get("stop_after", 1 << 30):
            ks = [key(j) for j in range(i, i + batch)]
            ok = store.put_many(ks, [[data(k, size)] for k in ks])
            out(**{"from": i, "ok": ok, "flushed": store.flush()})
            i += batch
    elif mode == "hold":
        n = o.get("n", 8)
        store.register_namespace(Namespace(model="paused", dtype="bfloat16", layout="page_first",
                                           page_size=16))
        ks = [key(j) for j in range(n)]
        out(ok=store.put_many(ks, [[data(k, size)] for k in ks]), flushed=store.flush())
        db = store._state.ix.writer.db
        db.execute("BEGIN IMMEDIATE")
        db.execute("UPDATE meta SET value=value WHERE name='used'")
        out(locked=True)
        sys.stdin.readline()
        db.execute("ROLLBACK")
        out(released=True)
        sys.stdin.readline()
    elif mode == "churn":
        n, end, rounds = o.get("n", 16), time.monotonic() + o.get("seconds", 5), 0
        while time.monotonic() < end:
            order = list(range(n)) if rounds % 2 else list(range(n))[::-1]
            ks = [key(j) for j in order]
            store.delete_many(ks)
            store.put_many(ks, [[data(k, size)] for k in ks])
            store.flush()
            rounds += 1
        out(rounds=rounds)
    elif mode == "reader":
        n, end = o.get("n", 16), time.monotonic() + o.get("seconds", 5)
        got = {"hits": 0, "misses": 0, "wrong": 0}
        ks = [key(j) for j in range(n)]
        while time.monotonic() < end:
            bufs = [bytearray(size) for _ in ks]
            for k, b, ok in zip(ks, bufs, store.get_many(ks, [[b] for b in bufs])):
                if not ok:
                    got["misses"] += 1
                elif bytes(b) == data(k, size):
                    got["hits"] += 1
                else:
                    got["wrong"] += 1
        st = store.stats()
        out(checksum_failures=st.checksum_failures, reused_reads=getattr(st, "reused_reads", 0),
            **got)
    elif mode == "sizes":
        first, sizes = o.get("first", 0), o["sizes"]
        ks = [key(first + i) for i in range(len(sizes))]
        ok = [store.put_many([k], [[data(k, n)]])[0] for k, n in zip(ks, sizes)]
        out(ok=ok, flushed=store.flush())
        wait_for(o["stop"])
    store.close()


if __name__ == "__main__":
    main()
