"""`sglang-offload bench store`: the block store against the raw disk it sits on, in one run.

Measures, for block sizes 256 KiB ... 16 MiB: durable put (timed until `flush()` returns: data
fdatasync'ed and committed to the index, visible to every process), cold get
(O_DIRECT, so the page cache is bypassed; on a buffered fallback the slabs are dropped from the page
cache first) and warm get (the same blocks read again), each in GB/s and as a ratio to the raw
O_DIRECT sequential bandwidth of the same directory, measured again beside each try (a shared or
virtual disk drifts; `--repeat` alternating tries, medians reported), and to the disk kept busy by
as many streams as store threads. Then the index at `--lookup-blocks` entries (default 100,000;
1M in the full run; bookkeeping only: entries are bulk-inserted as a rebuild would, no data is
written): `exists` and `locate` in microseconds per key in batches, and
the time to reopen the store (lock, integrity check, reclaim, load of the key set).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import random
import shutil
import statistics
import sys
import time
from typing import Any

from offload import argtypes
from offload.bench.common import (
    JSON,
    Args,
    Option,
    Outcome,
    dir_option,
    drop_cache,
    get_all,
    median_of,
    put_all,
    scratch,
    timed,
)
from offload.config import Size, StoreConfig, format_size

# The defaults are a quick look (well under a minute on one NVMe); the figures in
# docs/benchmarks.md come from the longer run written there (1GiB, every size, 1M index entries).
SIZES = [256 << 10, 1 << 20, 4 << 20, 16 << 20]
ALL_SIZES = [256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20]

OPTIONS = (
    dir_option("directory on the disk to measure"),
    Option(("--drives",), "instead of --dir: two or more directories, one per drive, comma-"
           "separated: one store over all of them (offload.store.paths) against their raw disks "
           "alone and all at once", None, argtypes.work_dirs, metavar="DIR,DIR,..."),
    Option(("--total",), "bytes written per block size and try", "256MiB", argtypes.size),
    Option(("--sizes",), "comma-separated block sizes (the full run: "
           + ",".join(format_size(s) for s in ALL_SIZES) + ")",
           ",".join(format_size(s) for s in SIZES), argtypes.size_list),
    Option(("--batch",), "blocks per put/get call", 32, argtypes.count),
    Option(("--threads",), "store I/O threads", 8, argtypes.count),
    Option(("--repeat",), "tries per block size, alternating with the raw disk (medians reported)",
           2, argtypes.count),
    Option(("--lookup-blocks",), "index entries for the lookup/reopen figures (0 to skip; the "
           "full run: 1000000)", 100_000, argtypes.natural),
    JSON,
)
log = logging.getLogger("offload.bench")


class Steps:
    """A progress bar over the benchmark's steps that names the step under way (on stderr)."""

    def __init__(self, total: int, what: str) -> None:
        from tqdm import tqdm

        self.what = what
        self.bar: Any = tqdm(total=total, desc=what, unit="step", file=sys.stderr, leave=False,
                             bar_format="{desc}: {n_fmt}/{total_fmt} steps [{elapsed}]")

    def start(self, step: str) -> None:
        log.debug("%s: %s", self.what, step)
        self.bar.set_description_str(f"{self.what}: {step}")

    def done(self) -> None:
        self.bar.update()

    def close(self) -> None:
        self.bar.close()


def bench_size(root: str, size: int, total: int, batch: int, threads: int) -> dict[str, float]:
    from offload.store.disk.spare import RANGE_BYTES, RANGE_SHARE
    from offload.store.disk.store import DiskStore

    d = os.path.join(root, f"store-{size}")
    n = max(batch, total // size)
    # a cap of a real cache's order (nothing evicted; slots reserved ahead in full ranges)
    cap = max(4 * n * size + (1 << 30), RANGE_SHARE * RANGE_BYTES)
    store = DiskStore(StoreConfig(path=d, capacity=Size(cap),
                                  io_threads=threads, min_free=Size(0)))
    src = mmap.mmap(-1, size * batch)
    src.write(os.urandom(1 << 20) * (size * batch >> 20) if size >= 1 << 20
              else os.urandom(size * batch))
    dst = mmap.mmap(-1, size * batch)
    views = [memoryview(src)[i * size:(i + 1) * size] for i in range(batch)]
    outs = [memoryview(dst)[i * size:(i + 1) * size] for i in range(batch)]
    keys = [os.urandom(32) for _ in range(n)]
    try:
        what = f"block size {size}"

        def get() -> None:
            get_all(store, keys, outs, batch, what)

        put_s = timed(lambda: put_all(store, keys, views, batch, what))
        if not store.o_direct:
            drop_cache(d, ".slab")
        res = {label: n * size / timed(get) / 1e9 for label in ("cold", "warm")}
        return {"block_bytes": size, "blocks": n, "put_gbps": n * size / put_s / 1e9,
                "cold_get_gbps": res["cold"], "warm_get_gbps": res["warm"]}
    finally:
        store.close()
        shutil.rmtree(d, ignore_errors=True)


def bench_index(root: str, nblocks: int) -> dict[str, float]:
    from offload.store.disk.index.db import Index
    from offload.store.disk.store import DiskStore

    d = os.path.join(root, "index")
    os.mkdir(d, 0o700)             # private, as a cache directory must be (no chmod warning)
    DiskStore(StoreConfig(path=d, capacity=Size(1 << 50), min_free=Size(0))).close()
    keys = [random.randbytes(32) for _ in range(nblocks)]
    idx = Index(os.path.join(d, "index.db"))
    sb = 8192
    idx.insert_recovered([(k, 1 + i // 65536, i % 65536, sb, 4096, i, 0.0)
                          for i, k in enumerate(keys)], [], [])
    idx.close()
    t = time.perf_counter()
    store = DiskStore(StoreConfig(path=d, capacity=Size(1 << 50), min_free=Size(0)))
    reopen_s = time.perf_counter() - t
    try:
        probe = random.sample(keys, min(200_000, nblocks // 2)) + \
            [random.randbytes(32) for _ in range(min(200_000, nblocks // 2))]
        random.shuffle(probe)
        exists_us = timed(lambda: [store.exists_many(probe[i:i + 1024])
                                   for i in range(0, len(probe), 1024)]) / len(probe) * 1e6
        sample = probe[:50_000]
        locate_us = timed(lambda: [store._index.locate(sample[i:i + 512])
                                   for i in range(0, len(sample), 512)]) / len(sample) * 1e6
    finally:
        store.close()
        shutil.rmtree(d, ignore_errors=True)
    return {"blocks": nblocks, "reopen_s": reopen_s, "exists_us_per_key": exists_us,
            "locate_us_per_key": locate_us}


def run(args: Args) -> Outcome:
    sizes = [int(Size.parse(s)) for s in args.sizes.split(",") if s.strip()]
    total = int(args.total)
    if args.drives:
        return _run_drives(args, sizes, total)
    out: dict[str, object] = {}
    with scratch(args.dir, "sglo-bench-") as root:
        out["dir"] = root
        bar = Steps(1 + len(sizes) * args.repeat + bool(args.lookup_blocks), "bench store")
        try:
            _measure(args, root, sizes, total, bar, out)
        finally:
            bar.close()
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _table(out)
    return Outcome(out)


def _run_drives(args: Args, sizes: list[int], total: int) -> Outcome:
    """`--drives`: the spread store over several drives (`offload/bench/drives.py`)."""
    from offload.bench import drives

    if args.dir:
        log.warning("--dir is ignored with --drives (the benchmark works on each drive)")
    bar = Steps(1 + len(sizes) * args.repeat, "bench store --drives")

    def step(what: str) -> None:
        if bar.bar.n or what != "raw disk of each drive alone":
            bar.done()
        bar.start(what)

    try:
        out = drives.measure(args.drives, sizes, total, args.batch, args.threads, args.repeat,
                             step)
        bar.done()
    finally:
        bar.close()
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        drives.table(out)
    return Outcome(out)


def _measure(args: Args, root: str, sizes: list[int], total: int, bar: Steps,
             out: dict[str, object]) -> None:
    """Each step of the run, in `root`; fills `out`."""
    from offload.bench.rawdisk import raw_bandwidth

    bar.start(f"raw disk, 1 and {args.threads} streams")
    raw_w, raw_r = raw_bandwidth(root, total)
    out["raw"] = {"write_gbps": raw_w, "read_gbps": raw_r, "chunk_bytes": 16 << 20,
                  "what": "sequential O_DIRECT, one stream, fdatasync at the end"}
    par_w, par_r = raw_bandwidth(root, total, streams=args.threads)
    out["raw_parallel"] = {"write_gbps": par_w, "read_gbps": par_r, "streams": args.threads,
                           "what": "O_DIRECT 16 MiB chunks, as many streams as store threads"}
    bar.done()
    rows = []
    for block in sizes:
        # A shared or virtual disk drifts: the raw disk is measured again next to each try
        # (alternating), and each figure is the median of --repeat tries.
        tries = []
        for t in range(args.repeat):
            bar.start(f"{format_size(block)} blocks, try {t + 1}/{args.repeat}")
            raw = raw_bandwidth(root, total)
            tries.append((raw, bench_size(root, block, total, args.batch, args.threads)))
            bar.done()
        raw_w, raw_r = (statistics.median(t[0][i] for t in tries) for i in (0, 1))
        r = median_of([t[1] for t in tries])
        r["block_bytes"], r["blocks"] = int(r["block_bytes"]), int(r["blocks"])
        r["raw_write_gbps"], r["raw_read_gbps"] = raw_w, raw_r
        r["put_ratio"] = r["put_gbps"] / raw_w
        r["cold_get_ratio"] = r["cold_get_gbps"] / raw_r
        r["warm_get_ratio"] = r["warm_get_gbps"] / raw_r
        r["put_ratio_parallel"] = r["put_gbps"] / par_w
        r["cold_get_ratio_parallel"] = r["cold_get_gbps"] / par_r
        rows.append(r)
    out["sizes"] = rows
    if args.lookup_blocks:
        bar.start(f"index of {args.lookup_blocks:,} entries")
        out["index"] = bench_index(root, args.lookup_blocks)
        bar.done()


def _table(out: dict) -> None:  # type: ignore[type-arg]
    raw = out["raw"]
    par = out["raw_parallel"]
    print(f"raw disk (O_DIRECT sequential): write {raw['write_gbps']:.2f} GB/s, "
          f"read {raw['read_gbps']:.2f} GB/s; with {par['streams']} streams: write "
          f"{par['write_gbps']:.2f} GB/s, read {par['read_gbps']:.2f} GB/s")
    print("medians of alternating tries; x raw = to the sequential raw disk measured beside that "
          "row; x par = to the parallel raw figure")
    print(f"{'block':>8} {'raw w':>6} {'put GB/s':>9} {'x raw':>6} {'x par':>6} {'raw r':>6} "
          f"{'cold get':>9} {'x raw':>6} {'x par':>6} {'warm get':>9} {'x raw':>6}")
    for r in out["sizes"]:
        print(f"{format_size(r['block_bytes']):>8} {r['raw_write_gbps']:6.2f} "
              f"{r['put_gbps']:9.2f} {r['put_ratio']:6.2f} "
              f"{r['put_ratio_parallel']:6.2f} {r['raw_read_gbps']:6.2f} {r['cold_get_gbps']:9.2f} "
              f"{r['cold_get_ratio']:6.2f} {r['cold_get_ratio_parallel']:6.2f} "
              f"{r['warm_get_gbps']:9.2f} {r['warm_get_ratio']:6.2f}")
    if "index" in out:
        i = out["index"]
        print(f"index at {i['blocks']:,} blocks: exists {i['exists_us_per_key']:.2f} us/key, "
              f"locate {i['locate_us_per_key']:.2f} us/key, reopen {i['reopen_s']:.2f} s")
