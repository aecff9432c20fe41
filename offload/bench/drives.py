"""`sglang-offload bench store --drives A,B,...`: one store over several drives against their raw
disks, in one run.

Per drive: the raw O_DIRECT sequential bandwidth alone (`rawdisk.raw_bandwidth`). All drives at
once: the same, every drive at the same time (the sum of their rates: what the drives give
together, lower than the sum of the alone figures when they share a device, a PCIe switch or a
CPU). Then, per block size, a `SpreadStore` over a scratch directory on each drive: durable put
(until `flush()`), cold get (the page cache bypassed or dropped) and warm get, in GB/s and as a
ratio to the all-at-once raw figure measured beside it (alternating tries, medians), with each
drive's share of the bytes and its rate during the cold get. Directories on one device are named
as such: on a one-disk machine the combined figure is that disk's, not a sum.
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from offload.bench.common import drop_cache, get_all, median_of, put_all, timed
from offload.config import Size, StoreConfig, format_size


def devices(dirs: list[str]) -> dict[int, list[str]]:
    """The directories by the device (st_dev) their file system is on."""
    out: dict[int, list[str]] = {}
    for d in dirs:
        out.setdefault(os.stat(d).st_dev, []).append(d)
    return out


def raw_all(dirs: list[str], total: int) -> tuple[float, float]:
    """(write, read) GB/s of every drive at once: each drive's raw run started together, rates
    summed."""
    from offload.bench.rawdisk import raw_bandwidth

    with ThreadPoolExecutor(len(dirs)) as pool:
        got = list(pool.map(lambda d: raw_bandwidth(d, total), dirs))
    return sum(w for w, _ in got), sum(r for _, r in got)


def bench_spread(roots: list[str], size: int, total: int, batch: int, threads: int
                 ) -> dict[str, Any]:
    from offload.store.disk.spread import SpreadStore

    dirs = [os.path.join(r, f"spread-{size}") for r in roots]
    n = max(batch, total // size)
    cap = 4 * n * size + len(dirs) * (1 << 30)
    store = SpreadStore(StoreConfig(paths=tuple(dirs), capacity=Size(cap), io_threads=threads,
                                    min_free=Size(0)), monitor=False)
    src = mmap.mmap(-1, size * batch)
    src.write(os.urandom(size * batch))
    dst = mmap.mmap(-1, size * batch)
    views = [memoryview(src)[i * size:(i + 1) * size] for i in range(batch)]
    outs = [memoryview(dst)[i * size:(i + 1) * size] for i in range(batch)]
    keys = [os.urandom(32) for _ in range(n)]

    def per_drive(field: str) -> list[int]:
        return [int(d.get(field, 0)) for d in store.stats().extra["drives"]]  # type: ignore

    try:
        what = f"block size {size}"

        def get() -> None:
            get_all(store, keys, outs, batch, what)

        put_s = timed(lambda: put_all(store, keys, views, batch, what))
        written = per_drive("bytes_written")
        for d, s in zip(dirs, store.drive_stores()):
            if not s.o_direct:
                drop_cache(d, ".slab")
        before = per_drive("bytes_read")
        cold_s = timed(get)
        read = [a - b for a, b in zip(per_drive("bytes_read"), before)]
        warm_s = timed(get)
        return {"block_bytes": size, "blocks": n, "put_gbps": n * size / put_s / 1e9,
                "cold_get_gbps": n * size / cold_s / 1e9, "warm_get_gbps": n * size / warm_s / 1e9,
                "drive_share": [w / max(1, sum(written)) for w in written],
                "drive_cold_gbps": [b / cold_s / 1e9 for b in read]}
    finally:
        store.close()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def measure(drives: Sequence[str], sizes: list[int], total: int, batch: int, threads: int,
            repeat: int, step: Any) -> dict[str, Any]:
    """The whole run over scratch directories made on each drive (removed at the end)."""
    from offload.bench.rawdisk import raw_bandwidth

    roots = [tempfile.mkdtemp(prefix="sglo-bench-", dir=d) for d in drives]
    try:
        by_dev = devices(roots)
        out: dict[str, Any] = {
            "drives": [], "devices": len(by_dev),
            "shared_device": [ds for ds in by_dev.values() if len(ds) > 1]}
        step("raw disk of each drive alone")
        for d, r in zip(drives, roots):
            w, rd = raw_bandwidth(r, total)
            out["drives"].append({"dir": d, "raw_write_gbps": w, "raw_read_gbps": rd})
        rows = []
        for block in sizes:
            tries = []
            for t in range(repeat):
                step(f"{format_size(block)} blocks over {len(drives)} drives, try {t + 1}/{repeat}")
                raw = raw_all(roots, total)
                tries.append((raw, bench_spread(roots, block, total, batch, threads)))
            raw_w, raw_r = (statistics.median(t[0][i] for t in tries) for i in (0, 1))
            lists = {k: [statistics.median(t[1][k][i] for t in tries) for i in range(len(drives))]
                     for k in ("drive_share", "drive_cold_gbps")}
            r = median_of([{k: v for k, v in t[1].items() if not isinstance(v, list)}
                           for t in tries])
            r.update(lists)
            r["block_bytes"], r["blocks"] = int(r["block_bytes"]), int(r["blocks"])
            r["raw_all_write_gbps"], r["raw_all_read_gbps"] = raw_w, raw_r
            r["put_ratio"] = r["put_gbps"] / raw_w
            r["cold_get_ratio"] = r["cold_get_gbps"] / raw_r
            rows.append(r)
        out["sizes"] = rows
        return out
    finally:
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)


def table(out: dict[str, Any]) -> None:
    n = len(out["drives"])
    print(f"{n} drives on {out['devices']} device(s)")
    for ds in out["shared_device"]:
        print(f"  note: {len(ds)} of these directories share one device: their figures 'all at "
              "once' are that device's bandwidth, not a sum of drives")
    print(f"{'drive':<40} {'raw w GB/s':>10} {'raw r GB/s':>10}   (each alone)")
    for d in out["drives"]:
        print(f"{d['dir']:<40} {d['raw_write_gbps']:10.2f} {d['raw_read_gbps']:10.2f}")
    print("medians of alternating tries; x raw = to every drive's raw disk at once, measured beside "
          "that row")
    print(f"{'block':>8} {'raw w':>6} {'put GB/s':>9} {'x raw':>6} {'raw r':>6} {'cold get':>9} "
          f"{'x raw':>6} {'warm get':>9}  cold get per drive GB/s (share of blocks)")
    for r in out["sizes"]:
        per = "  ".join(f"{g:.2f} ({s:.0%})" for g, s in zip(r["drive_cold_gbps"],
                                                            r["drive_share"]))
        print(f"{format_size(r['block_bytes']):>8} {r['raw_all_write_gbps']:6.2f} "
              f"{r['put_gbps']:9.2f} {r['put_ratio']:6.2f} {r['raw_all_read_gbps']:6.2f} "
              f"{r['cold_get_gbps']:9.2f} {r['cold_get_ratio']:6.2f} {r['warm_get_gbps']:9.2f}  "
              f"{per}")



__all__ = ["bench_spread", "devices", "measure", "raw_all", "table"]
