"""`sglang-offload bench hicache`: our HiCache backend against SGLang's stock `file` backend and the
raw disk, in one run, through SGLang's own interfaces.

A real SGLang host KV pool (MHA, Llama-3-8B-like pages: 64 tokens x 32 layers x 8 KV heads x 128 x
bf16 = 8 MiB, `page_first` by default) is filled with random pages. Then, in batches of SGLang's
`STORAGE_BATCH_SIZE` pages:

- ours (`OffloadStorage`, built by `StorageBackendFactory.create_backend("dynamic", ...)`):
  `batch_set_v1` (durable: the store commits a block after fdatasync), `batch_exists` (us per key,
  on full 128-key hit queries),
  cold `batch_get_v1` (O_DIRECT reads straight into the pool's pages);
- stock (`HiCacheFile`, the controller's generic path): `get_data_page` + `batch_set`, then fsync
  of every file and the directory (so "durable" means the same for both); the files are dropped
  from the page cache (posix_fadvise DONTNEED), then `batch_get` into dummy pages +
  `set_from_flat_data_page`, as the controller does;
- raw: sequential O_DIRECT write + fdatasync and read of a file of the same total size in the
  same directory (`offload.bench.rawdisk`).

`--restart` measures reads by a new process after the writer exited instead
(`offload.bench.restart`).

Every loaded page is checked against the original (outside the timings). Figures are GB/s and
ratios to the stock backend and to raw; `--check` exits 1 if the project targets are missed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any

from offload import argtypes
from offload.bench import common
from offload.bench.common import JSON, Args, Option, Outcome, drop_cache, fsync_files, timed
from offload.config import Size
from offload.hicache.contract import BACKEND_EXTRA

log = logging.getLogger("offload.bench")

TOKENS, LAYERS, HEADS, HEAD_DIM = 64, 32, 8, 128
TARGETS = {"write_vs_stock": 3.0, "read_vs_stock": 1.8, "write_vs_raw": 0.85,
           "read_vs_raw": 0.85, "exists_us_per_key": 2.0}
LAYOUTS = ("page_first", "page_first_direct", "layer_first")

OPTIONS = (
    common.dir_option("directory on the disk to measure"),
    Option(("--pages",), "pages of 8 MiB to move (default 256 = 2 GiB)", 256, argtypes.count),
    Option(("--layout",), "host pool layout (default page_first)", "page_first",
           choices=LAYOUTS),
    Option(("--threads",), "I/O threads of our store", 8, argtypes.count),
    Option(("--family",), "KV plus one model family's sidecar pool through the v2 interface, "
           "beside the stock file backend (offload.bench.families)", None,
           choices=("mha", "draft", "indexer", "mamba", "swa")),
    Option(("--restart",), "reads after a process restart instead: a new process reads what "
           "the writer left, from the page cache as it left it, then cold (offload.bench.restart)",
           flag=True),
    Option(("--page-cache",), "with --restart: our store's page-cache budget (store.page_cache; "
           "default: the config default, 0 = pure O_DIRECT)", None, argtypes.arg(Size.parse)),
    JSON,
    Option(("--check",), "exit 1 if a target is missed: " + ", ".join(
        f"{k} {'<=' if k.endswith('key') else '>='} {v}" for k, v in TARGETS.items()), flag=True),
)


def _quiet_sglang() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("sglang").setLevel(logging.WARNING)


def build_pool(pages: int, layout: str, layers: int = LAYERS) -> Any:
    """A real SGLang MHA host pool of `pages` pages of `layers` 256 KiB layers (8 MiB by
    default; CPU; page-aligned memory)."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    kv = MHATokenToKVPool(2 * TOKENS, TOKENS, torch.bfloat16, head_num=HEADS, head_dim=HEAD_DIM,
                          layer_num=layers, device="cpu", enable_memory_saver=False,
                          start_layer=0, end_layer=layers - 1)
    return MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 1.0, 0, TOKENS, layout,
                                pin_memory=False, device="cpu", device_capacity_tokens=kv.size,
                                start_layer=kv.start_layer, end_layer=kv.end_layer,
                                host_token_capacity=pages * TOKENS)


def fill_random(pool: Any) -> None:
    """Random bytes in every page: a random 64 MiB pattern, each page stamped with its number."""
    import numpy as np
    import torch

    flat = pool.kv_buffer.view(-1).view(torch.uint8).numpy()
    pattern = np.frombuffer(os.urandom(min(flat.size, 64 << 20)), dtype=np.uint8)
    for off in range(0, flat.size, pattern.size):
        n = min(pattern.size, flat.size - off)
        flat[off:off + n] = pattern[:n]
    for p in range(pool.size // TOKENS):
        v = pool.get_data_page(p * TOKENS, flat=False)
        while not v.is_contiguous():
            v = v[0]
        v.reshape(-1).view(torch.int16)[:4] = torch.tensor([p & 0x7FFF, p >> 15, 7, 11],
                                                           dtype=torch.int16)


def page_digests(pool: Any) -> list[int]:
    import torch
    import xxhash

    out = []
    for p in range(pool.size // TOKENS):
        page = pool.get_data_page(p * TOKENS, flat=True).contiguous()
        out.append(xxhash.xxh3_64_intdigest(page.view(torch.uint8).numpy()))
    return out


def storage_config(extra: dict) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                is_page_first_layout=False, model_name="bench/llama-3-8b-like",
                                extra_config=extra)


def _batches(n: int) -> list[tuple[int, int]]:
    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE

    return [(i, min(n, i + STORAGE_BATCH_SIZE)) for i in range(0, n, STORAGE_BATCH_SIZE)]


def exists_batches(keys: list[str]) -> list[list[str]]:
    """Hit queries as the controller sends them: full batches of STORAGE_BATCH_SIZE keys (the
    stored keys, repeated if there are fewer), so the per-key figure does not depend on --pages."""
    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE

    n = max(len(keys), STORAGE_BATCH_SIZE)
    cycled = [keys[i % len(keys)] for i in range(n)]
    return [cycled[i:i + STORAGE_BATCH_SIZE] for i in range(0, n, STORAGE_BATCH_SIZE)]


def ours_extra(root: str, total: int, threads: int) -> dict[str, Any]:
    """Our backend's extra config (what `launch` composes) over a store in `root/offload` sized
    for `total` bytes, on the cpu path."""
    return {**BACKEND_EXTRA,
            "offload": {"store": {"path": os.path.join(root, "offload"),
                                  "capacity": 2 * total + (1 << 30), "min_free": 0,
                                  "io_threads": threads},
                        "transfer": {"path": "cpu"},
                        # the bench measures the tier, not when loading beats prefill
                        "worth_it": {"enabled": False}}}


def bench_ours(root: str, pool: Any, keys: list[str], threads: int) -> dict[str, float]:
    import torch
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    total = len(keys) * pool.get_size_per_token() * TOKENS
    extra = ours_extra(root, total, threads)
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
    backend.register_mem_pool_host(pool)
    batches = _batches(len(keys))

    def idx(a: int, b: int) -> torch.Tensor:
        return torch.arange(a * TOKENS, b * TOKENS)

    def write() -> None:
        for a, b in batches:
            if not all(backend.batch_set_v1(keys[a:b], idx(a, b))):
                raise RuntimeError("offload: batch_set_v1 failed")

    def read() -> None:
        for a, b in batches:
            if not all(backend.batch_get_v1(keys[a:b], idx(a, b))):
                raise RuntimeError("offload: batch_get_v1 missed")

    try:
        want = page_digests(pool)
        write_s = timed(write)
        probe = exists_batches(keys)

        def exists_round() -> None:
            for batch in probe:
                if backend.batch_exists(batch) != len(batch):
                    raise RuntimeError("offload: batch_exists missed")

        rounds, exists_s = 0, 0.0
        while exists_s < 0.3 and rounds < 1000:
            exists_s += timed(exists_round)
            rounds += 1
        o_direct = bool(backend.store.stats().extra.get("o_direct"))
        if not o_direct:
            drop_cache(os.path.join(root, "offload"), ".slab")
        pool.kv_buffer.zero_()
        read_s = timed(read)
        if page_digests(pool) != want:
            raise RuntimeError("offload: pages read back differ from those written")
    finally:
        backend.close()
    return {"write_gbps": total / write_s / 1e9, "read_gbps": total / read_s / 1e9,
            "exists_us_per_key": exists_s / (rounds * sum(map(len, probe))) * 1e6,
            "o_direct": o_direct}


def bench_stock(root: str, pool: Any, keys: list[str]) -> dict[str, float]:
    """SGLang's `file` backend through the controller's generic (copying) page path."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    d = os.path.join(root, "stock")
    backend = HiCacheFile(storage_config({"file_storage_path": d}), file_path=d)
    total = len(keys) * pool.get_size_per_token() * TOKENS
    batches = _batches(len(keys))

    def write() -> None:
        for a, b in batches:
            data = [pool.get_data_page(i * TOKENS) for i in range(a, b)]
            if not backend.batch_set(keys[a:b], data):
                raise RuntimeError("stock: batch_set failed")
        fsync_files(d, ".bin")

    def read() -> None:
        for a, b in batches:
            dummy = [pool.get_dummy_flat_data_page() for _ in range(a, b)]
            got = backend.batch_get(keys[a:b], dummy)
            for i, page in zip(range(a, b), got):
                if page is None:
                    raise RuntimeError("stock: batch_get missed")
                pool.set_from_flat_data_page(i * TOKENS, page)

    want = page_digests(pool)
    write_s = timed(write)
    probe = exists_batches(keys)
    t = time.perf_counter()
    rounds = 0
    while time.perf_counter() - t < 0.3 and rounds < 100:
        for batch in probe:
            backend.batch_exists(batch)
        rounds += 1
    exists_us = (time.perf_counter() - t) / (rounds * sum(map(len, probe))) * 1e6
    drop_cache(d, ".bin")
    pool.kv_buffer.zero_()
    read_s = timed(read)
    if page_digests(pool) != want:
        raise RuntimeError("stock: pages read back differ from those written")
    return {"write_gbps": total / write_s / 1e9, "read_gbps": total / read_s / 1e9,
            "exists_us_per_key": exists_us}


def run(args: Args) -> Outcome:
    from offload.bench.rawdisk import raw_bandwidth

    _quiet_sglang()
    if getattr(args, "family", None):
        return _run_family(args)
    if getattr(args, "restart", False):
        from offload.bench.restart import run_restart

        return run_restart(args)
    pool = build_pool(args.pages, args.layout)
    page_bytes = pool.get_size_per_token() * TOKENS
    total = args.pages * page_bytes
    root = tempfile.mkdtemp(prefix="sglo-bench-hicache-", dir=args.dir)
    run_id = uuid.uuid4().hex[:16]
    keys = [f"{run_id}{i:048x}" for i in range(args.pages)]
    out: dict[str, Any] = {"dir": root, "pages": args.pages, "page_bytes": page_bytes,
                           "total_bytes": total, "layout": args.layout,
                           "page": f"{TOKENS} tokens x {LAYERS} layers x {HEADS} heads x "
                                   f"{HEAD_DIM} x bf16 x K,V"}
    try:
        fill_random(pool)
        log.debug("bench hicache: %d pages of %d bytes in %s, layout %s", args.pages, page_bytes,
                  root, args.layout)
        raw_w, raw_r = raw_bandwidth(root, total)
        out["raw"] = {"write_gbps": raw_w, "read_gbps": raw_r}
        log.debug("bench hicache: raw disk %s", out["raw"])
        out["stock_file"] = bench_stock(root, pool, keys)
        log.debug("bench hicache: stock file backend %s", out["stock_file"])
        shutil.rmtree(os.path.join(root, "stock"), ignore_errors=True)
        out["offload"] = bench_ours(root, pool, keys, args.threads)
        log.debug("bench hicache: offload backend %s", out["offload"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
        log.debug("bench hicache: removed %s", root)
    ours, stock = out["offload"], out["stock_file"]
    out["ratios"] = {
        "write_vs_stock": ours["write_gbps"] / stock["write_gbps"],
        "read_vs_stock": ours["read_gbps"] / stock["read_gbps"],
        "write_vs_raw": ours["write_gbps"] / raw_w,
        "read_vs_raw": ours["read_gbps"] / raw_r,
        "stock_write_vs_raw": stock["write_gbps"] / raw_w,
        "stock_read_vs_raw": stock["read_gbps"] / raw_r,
        "exists_us_per_key": ours["exists_us_per_key"],
    }
    r = out["ratios"]
    out["targets_met"] = {k: (r[k] <= v if k.endswith("key") else r[k] >= v)
                          for k, v in TARGETS.items()}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _table(out)
    return Outcome(out, 1 if args.check and not all(out["targets_met"].values()) else 0)


def _run_family(args: Args) -> Outcome:
    from offload.bench.families import bench_family

    root = tempfile.mkdtemp(prefix="sglo-bench-family-", dir=args.dir)
    try:
        out = bench_family(root, args.family, args.pages, args.layout, args.threads)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    r = out["ratios"]
    out["targets_met"] = {k: r[k] >= TARGETS[k] for k in ("write_vs_stock", "read_vs_stock")}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"family {out['family']} ({out['pool']}): {out['pages']} KV pages of "
              f"{out['kv_page_bytes'] >> 10} KiB + sidecar pages of "
              f"{out['sidecar_page_bytes'] >> 10} KiB, {out['total_bytes'] / 1e9:.2f} GB")
        for name, key in (("SGLang file backend", "stock_file"), ("offload backend", "offload")):
            print(f"{name:22} write {out[key]['write_gbps']:6.2f} GB/s  "
                  f"cold read {out[key]['read_gbps']:6.2f} GB/s")
        print(f"offload vs stock: write {r['write_vs_stock']:.2f}x, read {r['read_vs_stock']:.2f}x")
    return Outcome(out, 1 if args.check and not all(out["targets_met"].values()) else 0)


def _table(out: dict[str, Any]) -> None:
    raw, ours, stock, r = out["raw"], out["offload"], out["stock_file"], out["ratios"]
    print(f"{out['pages']} pages of {out['page_bytes'] >> 20} MiB ({out['page']}), "
          f"layout {out['layout']}, {out['total_bytes'] / 1e9:.2f} GB")
    print(f"{'':22} {'durable write':>14} {'cold read':>10} {'exists us/key':>14}")
    print(f"{'raw disk (O_DIRECT)':22} {raw['write_gbps']:11.2f} GB/s {raw['read_gbps']:7.2f} GB/s")
    print(f"{'SGLang file backend':22} {stock['write_gbps']:11.2f} GB/s "
          f"{stock['read_gbps']:7.2f} GB/s {stock['exists_us_per_key']:14.2f}")
    print(f"{'offload backend':22} {ours['write_gbps']:11.2f} GB/s {ours['read_gbps']:7.2f} GB/s "
          f"{ours['exists_us_per_key']:14.2f}")
    print(f"offload vs stock: write {r['write_vs_stock']:.2f}x, read {r['read_vs_stock']:.2f}x; "
          f"vs raw: write {r['write_vs_raw']:.2f}x, read {r['read_vs_raw']:.2f}x "
          f"(stock vs raw: {r['stock_write_vs_raw']:.2f}x, {r['stock_read_vs_raw']:.2f}x)")
    missed = [k for k, ok in out["targets_met"].items() if not ok]
    print("targets: " + ("all met" if not missed else "missed " + ", ".join(missed)),
          file=sys.stdout)
