"""`sglang-offload bench hicache --restart`: reads after a process restart, ours against SGLang's
stock `file` backend, through SGLang's own interfaces (the pool and backends of `hicache.py`).

A deploy restarts the server: what the old process wrote may still be in the kernel's page cache.
Process 1 fills a real host pool with random pages, writes them through both backends (ours:
`batch_set_v1`, durable; stock: `batch_set` + fsync of every file), saves the pages' digests and
exits. Process 2 (the restarted server) builds an empty pool and reads every page through each
backend — warm: the page cache as process 1 left it; then cold: every file of both written back
and dropped from the page cache (`drop_tree_cache`) — checking each page against the digests.
Ours counts the pages it served from the page cache (`reads_cached`, `store.page_cache`).

Primitives: `run_restart(args) -> Outcome`; `python -m offload.bench.restart PHASE JSON` is one
process's phase (`write` / `read`), its result one JSON line on stdout (no pickle).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from typing import Any

from offload.bench import hicache
from offload.bench.common import Args, Outcome, drop_tree_cache, fsync_files, timed
from offload.config import StoreConfig


def _phase(phase: str, opts: dict[str, Any]) -> dict[str, Any]:
    """One phase in a process of its own (a real restart between them)."""
    r = subprocess.run([sys.executable, "-m", "offload.bench.restart", phase, json.dumps(opts)],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"bench hicache --restart: the {phase} process failed "
                           f"(exit {r.returncode}): {r.stderr.strip()[-2000:]}")
    got: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return got


def _backend(opts: dict[str, Any], pool: Any) -> Any:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    total = len(opts["keys"]) * pool.get_size_per_token() * hicache.TOKENS
    extra = hicache.ours_extra(opts["root"], total, opts["threads"])
    if opts.get("page_cache") is not None:
        extra["offload"]["store"]["page_cache"] = opts["page_cache"]
    backend = StorageBackendFactory.create_backend("dynamic", hicache.storage_config(extra), pool)
    backend.register_mem_pool_host(pool)
    return backend


def _cached(backend: Any) -> int:
    """Hits our store served from the page cache so far (its `reads_cached`)."""
    n = backend.store.stats().extra.get("reads_cached", 0)
    return int(n) if isinstance(n, int) else 0


def _write(opts: dict[str, Any]) -> dict[str, Any]:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    pool = hicache.build_pool(opts["pages"], opts["layout"])
    hicache.fill_random(pool)
    keys = opts["keys"]
    ours = _backend(opts, pool)
    try:
        for a, b in hicache._batches(len(keys)):
            if not all(ours.batch_set_v1(keys[a:b], torch.arange(a * hicache.TOKENS,
                                                                 b * hicache.TOKENS))):
                raise RuntimeError("offload: batch_set_v1 failed")
    finally:
        ours.close()
    d = os.path.join(opts["root"], "stock")
    stock = HiCacheFile(hicache.storage_config({"file_storage_path": d}), file_path=d)
    for a, b in hicache._batches(len(keys)):
        if not stock.batch_set(keys[a:b], [pool.get_data_page(i * hicache.TOKENS)
                                           for i in range(a, b)]):
            raise RuntimeError("stock: batch_set failed")
    fsync_files(d, ".bin")
    return {"digests": hicache.page_digests(pool)}


def _read(opts: dict[str, Any]) -> dict[str, Any]:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    pool = hicache.build_pool(opts["pages"], opts["layout"])
    keys, want = opts["keys"], opts["digests"]
    total = len(keys) * pool.get_size_per_token() * hicache.TOKENS
    batches = hicache._batches(len(keys))
    d = os.path.join(opts["root"], "stock")
    stock = HiCacheFile(hicache.storage_config({"file_storage_path": d}), file_path=d)

    def read_stock() -> None:
        for a, b in batches:
            got = stock.batch_get(keys[a:b], [pool.get_dummy_flat_data_page() for _ in range(a, b)])
            for i, page in zip(range(a, b), got):
                if page is None:
                    raise RuntimeError("stock: batch_get missed")
                pool.set_from_flat_data_page(i * hicache.TOKENS, page)

    out: dict[str, Any] = {}
    ours = _backend(opts, pool)
    try:
        def read_ours() -> None:
            for a, b in batches:
                if not all(ours.batch_get_v1(keys[a:b], torch.arange(a * hicache.TOKENS,
                                                                     b * hicache.TOKENS))):
                    raise RuntimeError("offload: batch_get_v1 missed")

        for case in ("warm", "cold"):
            if case == "cold":
                drop_tree_cache(opts["root"])
            for name, fn in (("offload", read_ours), ("stock_file", read_stock)):
                before = _cached(ours)
                pool.kv_buffer.zero_()
                s = timed(fn)
                if hicache.page_digests(pool) != want:
                    raise RuntimeError(f"{name}: pages read after the restart differ")
                row = out.setdefault(name, {})
                row[f"{case}_read_gbps"] = total / s / 1e9
                if name == "offload":
                    row[f"{case}_pages_cached"] = _cached(ours) - before
    finally:
        ours.close()
    return out


def run_restart(args: Args) -> Outcome:
    root = tempfile.mkdtemp(prefix="sglo-bench-restart-", dir=args.dir)
    run_id = uuid.uuid4().hex[:16]
    opts: dict[str, Any] = {"root": root, "pages": args.pages, "layout": args.layout,
                            "threads": args.threads, "page_cache": args.page_cache,
                            "keys": [f"{run_id}{i:048x}" for i in range(args.pages)]}
    try:
        opts["digests"] = _phase("write", opts)["digests"]
        got = _phase("read", opts)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ours, stock = got["offload"], got["stock_file"]
    ours["page_cache_bytes"] = (StoreConfig().page_cache if args.page_cache is None
                                else args.page_cache)
    page = hicache.TOKENS * hicache.LAYERS * hicache.HEADS * hicache.HEAD_DIM * 2 * 2
    out = {"pages": args.pages, "page_bytes": page, "total_bytes": args.pages * page,
           "layout": args.layout, "offload": ours, "stock_file": stock,
           "ratios": {c: ours[f"{c}_read_gbps"] / stock[f"{c}_read_gbps"]
                      for c in ("warm", "cold")}}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{args.pages} pages of {page >> 20} MiB, {out['total_bytes'] / 1e9:.2f} GB, read "
              f"by a new process after the writer exited; page_cache "
              f"{ours['page_cache_bytes'] / 2**30:.2f} GiB")
        print(f"{'':22} {'after restart':>14} {'cold (dropped)':>15}")
        for name, row in (("SGLang file backend", stock), ("offload backend", ours)):
            print(f"{name:22} {row['warm_read_gbps']:9.2f} GB/s {row['cold_read_gbps']:10.2f} GB/s")
        print(f"offload vs stock: after restart {out['ratios']['warm']:.2f}x "
              f"({ours['warm_pages_cached']}/{args.pages} pages from the page cache), "
              f"cold {out['ratios']['cold']:.2f}x")
    return Outcome(out, 0)


def main() -> None:
    phase, opts = sys.argv[1], json.loads(sys.argv[2])
    hicache._quiet_sglang()
    got = _write(opts) if phase == "write" else _read(opts)
    print(json.dumps(got), flush=True)


if __name__ == "__main__":
    main()
