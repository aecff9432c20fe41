"""Worker for the HiCache multi-process tests (restart, replicas on one directory).

`python worker.py '<json>'` (or `run(opts)` in the test process itself) with keys: dir, layout,
mla, write (list of [seed, first_page, n]: fill the pool with `seed`, store n pages of prompt
`seed` from host page first_page), read (list of
[seed, n]: load n pages of prompt `seed` and compare with a pool filled with `seed`),
wait_for / done (file paths: a barrier between processes), then (options of a second run in
the same process, e.g. another pool kind). Prints one JSON line; no pickle.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from tests.hicache import hicache_pools as hp  # noqa: E402

P = hp.PAGE


def prompt_keys(seed: int, n: int) -> list[str]:
    return [f"{seed:08x}{i:056x}" for i in range(n)]


def run(opts: dict) -> dict:
    """Do what `opts` says (see the module docstring) in this process; returns the result."""
    mla = bool(opts.get("mla", False))
    layout = opts.get("layout", "page_first")
    host = hp.host_pool(hp.device_pool(mla), layout, pages=24)
    sc = hp.storage_config(hp.extra(opts["dir"]), mla=mla, layout=layout)
    backend = hp.make_backend(sc, host)
    out: dict = {"pid": os.getpid(), "written": [], "read": []}
    for seed, first, n in opts.get("write", []):
        hp.fill(host, seed)
        idx = torch.arange(first * P, (first + n) * P)
        out["written"].append(sum(backend.batch_set_v1(prompt_keys(seed, n), idx)))
    if opts.get("done"):
        hp.durable(backend)   # finished writing: visible to the other process
        open(opts["done"], "w").close()
    deadline = time.monotonic() + 60
    for path in opts.get("wait_for", []):
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
    for seed, n in opts.get("read", []):
        keys = prompt_keys(seed, n)
        exists = backend.batch_exists(keys)
        hp.fill(host, seed + 1000)  # scribble over the pool, then load into pages 8..
        ok = backend.batch_get_v1(keys, torch.arange(8 * P, (8 + n) * P))
        got = [hp.page_bytes(host, (8 + i) * P) for i in range(n)]
        hp.fill(host, seed)
        # Writers stored prompt `seed` from page 0 (see the tests): compare with those pages.
        want = [hp.page_bytes(host, i * P) for i in range(n)]
        out["read"].append({"exists": exists, "ok": sum(ok),
                            "exact": sum(g == w for g, w in zip(got, want))})
    backend.close()
    if opts.get("then"):  # a second backend (other pool kind) in the same process
        out["then"] = run({"dir": opts["dir"], **opts["then"]})
    return out


def main() -> None:
    print(json.dumps(run(json.loads(sys.argv[1]))), flush=True)


if __name__ == "__main__":
    main()
