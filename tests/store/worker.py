"""Subprocess worker for the disk-store tests: `python worker.py MODE DIR [ARGS]` (no pickle)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from offload.config import Size, StoreConfig  # noqa: E402
from offload.store.disk.store import DiskStore  # noqa: E402
from tests.store.blocks import data, key  # noqa: E402


def open_from_argv(threads: int) -> tuple[str, str, dict, DiskStore]:
    """MODE, DIR, the JSON options and a store on DIR (`capacity`, `threads` from the options)."""
    mode, directory = sys.argv[1], sys.argv[2]
    opts = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    cfg = StoreConfig(path=directory, capacity=Size(opts.get("capacity", 1 << 30)),
                      min_free=Size(0), io_threads=opts.get("threads", threads))
    return mode, directory, opts, DiskStore(cfg)


def main() -> None:
    mode, directory, opts, store = open_from_argv(threads=4)
    size = opts.get("size", 65536)
    if mode == "write":  # write blocks start..stop, print each committed index
        start, stop, batch = opts["start"], opts["stop"], opts.get("batch", 4)
        for i in range(start, stop, batch):
            ks = [key(j) for j in range(i, min(stop, i + batch))]
            ok = store.put_many(ks, [[data(k, size)] for k in ks])
            store.flush()  # put returns once written; a block is committed once durable
            ok = [o and e for o, e in zip(ok, store.exists_many(ks))]
            print(json.dumps({"from": i, "ok": ok}), flush=True)
    elif mode == "read":  # print which of blocks 0..n read back byte-exact / wrong / missing
        n = opts["n"]
        out = {"exact": 0, "wrong": 0, "missing": 0, "exists": 0}
        for i in range(n):
            k = key(i)
            out["exists"] += store.exists_many([k])[0]
            buf = bytearray(size)
            if not store.get_many([k], [[buf]])[0]:
                out["missing"] += 1
            elif bytes(buf) == data(k, size):
                out["exact"] += 1
            else:
                out["wrong"] += 1
        print(json.dumps(out), flush=True)
    if opts.get("die"):   # as a crash would: no close (its reserved range is not given back)
        os._exit(0)
    store.close()


if __name__ == "__main__":
    main()
