"""`sglang-offload bench contend`: an L3 read beside a saturating write-back, against the drive's
own read beside a raw writer, in one run (issue 35: loads before stores).

Ours goes through SGLang's own storage factory (`StorageBackendFactory.create_backend("dynamic",
...)`, the cpu path) over a real SGLang `page_first` MHA host pool (`bench hicache`'s): pages of
`--page-size` (64 tokens x 8 KV heads x 128 x bf16 x K,V = 256 KiB per layer). Four phases of
`--seconds` each, in this order:

1. raw alone: reads of `--read-pages` pages of an O_DIRECT file in the directory (as many
   streams as our store has I/O threads, at most one per page), one every `READ_GAP_S`;
2. raw beside a writer: the same, while a thread writes `--write-batch`-page batches to another
   O_DIRECT file in the directory and fdatasyncs each, without pause;
3. ours alone: a prefetch of `--read-pages` stored pages (`batch_get_v1`) every `READ_GAP_S`;
4. ours beside the write-back: the same, while a backup thread stores `--write-batch`-page
   batches of new keys (`batch_set_v1`) without pause, as SGLang's backup thread would; the
   store's capacity holds the read pages and a few batches, so the write-back also evicts.

Each read's latency is the whole call; the figures are p50 / p90 per phase, the writer's GB/s,
the pages the write-back had refused (the cpu path's bounded write lane), any read that
missed, and the disk store's own counts of write calls held back by a read and commit rounds
whose flushes waited for reads (`offload/store/disk/slab/gate.py`). Target: ours beside the
write-back <= 2 x raw beside the writer + 20 ms (p90); `ratio` is ours over that limit (<= 1
meets it), `--check` exits 1 when it is missed. Every page read is checked against what was
written (outside the timings). On a file system without O_DIRECT both sides use buffered I/O.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from offload import argtypes
from offload.bench import common
from offload.bench.common import JSON, Args, Option, Outcome
from offload.bench.hicache import HEAD_DIM, HEADS, TOKENS

log = logging.getLogger("offload.bench")

LAYER_BYTES = TOKENS * HEADS * HEAD_DIM * 2 * 2      # one layer of a page: K and V, bf16
READ_GAP_S = 0.01             # between two reads: they sample the latency, not saturate
MIN_READS = 5                 # per phase, however short --seconds is
TARGET_SLACK_S = 0.020        # the target: ours p90 <= 2 x raw p90 + this
KEPT_BATCHES = 4              # write-back batches the store's capacity holds beside the reads
IO_THREADS = 8                # our store's I/O threads (offload.store.io_threads' default)


def page_size(text: str) -> int:
    """Bytes, a multiple of 256 KiB (one layer of 64 tokens x 8 KV heads x 128 x bf16 x K,V)."""
    n = argtypes.size(text)
    if n % LAYER_BYTES:
        raise ValueError(f"must be a multiple of {LAYER_BYTES >> 10} KiB (one layer of a page)")
    return n


OPTIONS = (
    common.dir_option("directory on the drive to measure"),
    Option(("--page-size",), "bytes per page, a multiple of 256 KiB: one layer of 64 tokens x 8 "
           "KV heads x 128 x bf16 x K,V (default 2MiB, 8 layers)", "2MiB", page_size,
           metavar="SIZE"),
    Option(("--read-pages",), "pages each prefetch reads", 8, argtypes.count),
    Option(("--write-batch",), "pages of each write-back batch", 64, argtypes.count),
    Option(("--seconds",), "seconds each of the four phases runs", 5.0, argtypes.positive),
    JSON,
    Option(("--check",), "exit 1 if ours beside the write-back is over 2 x raw beside the writer "
           "+ 20 ms (p90)", flag=True),
)


def percentile(xs: list[float], q: float) -> float:
    """The nearest-rank percentile `q` (0..1) of `xs`."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


def summary(lat: list[float]) -> dict[str, Any]:
    return {"reads": len(lat), "p50_ms": percentile(lat, 0.5) * 1e3,
            "p90_ms": percentile(lat, 0.9) * 1e3}


class Writer:
    """A thread calling `step()` (one batch: returns pages stored, pages refused) until stopped."""

    def __init__(self, step: Callable[[], tuple[int, int]], page_bytes: int):
        self.step, self.page_bytes = step, page_bytes
        self.stored = self.refused = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-contend-writer",
                                        daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                stored, refused = self.step()
                self.stored += stored
                self.refused += refused
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.error = e

    def __enter__(self) -> "Writer":
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self._t0
        if self.error is not None:
            raise RuntimeError(f"the writer failed: {self.error}") from self.error

    def figures(self) -> dict[str, Any]:
        return {"writer_gbps": self.stored * self.page_bytes / self.seconds / 1e9,
                "writer_pages": self.stored, "write_refused_pages": self.refused}


def sample(read: Callable[[], bool], seconds: float) -> tuple[list[float], int]:
    """Latencies of `read()` calls for `seconds` (at least MIN_READS), and how many missed."""
    lat: list[float] = []
    missed = 0
    end = time.perf_counter() + seconds
    while len(lat) < MIN_READS or time.perf_counter() < end:
        t = time.perf_counter()
        ok = read()
        lat.append(time.perf_counter() - t)
        missed += not ok
        time.sleep(READ_GAP_S)
    return lat, missed


class RawFile:
    """A file of `pages` pages in `root`, O_DIRECT where the file system allows it."""

    def __init__(self, root: str, name: str, pages: int, page_bytes: int):
        self.path = os.path.join(root, name)
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        try:
            self.fd = os.open(self.path, flags | os.O_DIRECT, 0o600)
            self.direct = True
        except OSError:
            self.fd = os.open(self.path, flags, 0o600)
            self.direct = False
        self.pages, self.page_bytes = pages, page_bytes
        os.posix_fallocate(self.fd, 0, pages * page_bytes)

    def close(self) -> None:
        os.close(self.fd)


def bench_raw(root: str, args: Args, streams: int) -> dict[str, Any]:
    pb = args.page_size
    reader = RawFile(root, ".contend-read", args.read_pages, pb)
    writer = RawFile(root, ".contend-write", 2 * args.write_batch, pb)
    bufs = [mmap.mmap(-1, pb) for _ in range(max(streams, 1))]
    data = mmap.mmap(-1, pb)
    data.write(os.urandom(pb))
    pool = ThreadPoolExecutor(streams)
    wpool = ThreadPoolExecutor(streams)
    try:
        list(pool.map(lambda i: os.pwrite(reader.fd, data, i * pb), range(args.read_pages)))
        os.fdatasync(reader.fd)
        if not reader.direct:
            os.posix_fadvise(reader.fd, 0, 0, os.POSIX_FADV_DONTNEED)

        def read() -> bool:
            got = pool.map(lambda i: os.preadv(reader.fd, [bufs[i % streams]], i * pb),
                           range(args.read_pages))
            return all(n == pb for n in got)

        batch = [0]

        def write() -> tuple[int, int]:
            base = (batch[0] % 2) * args.write_batch
            batch[0] += 1
            list(wpool.map(lambda i: os.pwrite(writer.fd, data, (base + i) * pb),
                           range(args.write_batch)))
            os.fdatasync(writer.fd)
            return args.write_batch, 0

        out: dict[str, Any] = {"o_direct": reader.direct}
        lat, missed = sample(read, args.seconds)
        out["alone"] = summary(lat)
        with Writer(write, pb) as w:
            lat, more = sample(read, args.seconds)
        out["beside"] = {**summary(lat), **w.figures()}
        if missed or more:
            raise RuntimeError("raw: a read came back short")
        return out
    finally:
        pool.shutdown()
        wpool.shutdown()
        for f in (reader, writer):
            f.close()
            os.unlink(f.path)
        for b in (*bufs, data):
            b.close()


def bench_ours(root: str, args: Args) -> dict[str, Any]:
    import torch
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from offload.bench.hicache import build_pool, fill_random, ours_extra, page_digests, storage_config
    from offload.store.base import flush

    n_read, n_write, pb = args.read_pages, args.write_batch, args.page_size
    pool = build_pool(n_read + n_write, "page_first", pb // LAYER_BYTES)
    fill_random(pool)
    want = page_digests(pool)
    run_id = uuid.uuid4().hex[:16]
    read_keys = [f"{run_id}r{i:047x}" for i in range(n_read)]
    read_idx = torch.arange(0, n_read * TOKENS)
    write_idx = torch.arange(n_read * TOKENS, (n_read + n_write) * TOKENS)
    # the capacity (2 x this + 1 GiB, `ours_extra`) holds the read pages and a few batches
    extra = ours_extra(root, (n_read + KEPT_BATCHES * n_write) * pb, IO_THREADS)
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
    try:
        backend.register_mem_pool_host(pool)
        if not all(backend.batch_set_v1(read_keys, read_idx)) or not flush(backend.store):
            raise RuntimeError("offload: the pages to read could not be stored")
        batch = [0]

        def write() -> tuple[int, int]:
            keys = [f"{run_id}w{batch[0]:015x}{i:032x}" for i in range(n_write)]
            batch[0] += 1
            ok = backend.batch_set_v1(keys, write_idx)
            return sum(ok), len(ok) - sum(ok)

        def read() -> bool:
            return all(backend.batch_get_v1(read_keys, read_idx))

        out: dict[str, Any] = {"o_direct": bool(backend.store.stats().extra.get("o_direct"))}
        lat, missed = sample(read, args.seconds)
        out["alone"] = summary(lat)
        with Writer(write, pb) as w:
            lat, more = sample(read, args.seconds)
        out["beside"] = {**summary(lat), **w.figures()}
        out["read_misses"] = missed + more
        extra = backend.store.stats().extra   # the disk store's reads-first gate, if it has one
        out["writes_held"] = extra.get("writes_held")
        out["flushes_delayed"] = extra.get("flushes_delayed")
        if page_digests(pool) != want:
            raise RuntimeError("offload: pages read back differ from those written")
        return out
    finally:
        backend.close()


def run(args: Args) -> Outcome:
    from offload.bench.hicache import _quiet_sglang

    _quiet_sglang()
    out: dict[str, Any] = {"bench": "contend", "page_bytes": args.page_size,
                           "read_pages": args.read_pages, "write_batch": args.write_batch,
                           "seconds": args.seconds, "read_gap_ms": READ_GAP_S * 1e3}
    with common.scratch(args.dir, "sglo-bench-contend-") as root:
        out["dir"] = root
        out["raw"] = bench_raw(root, args, min(args.read_pages, IO_THREADS))
        log.debug("bench contend: raw %s", out["raw"])
        out["offload"] = bench_ours(root, args)
        log.debug("bench contend: offload %s", out["offload"])
    limit = 2 * out["raw"]["beside"]["p90_ms"] + TARGET_SLACK_S * 1e3
    ours = out["offload"]["beside"]["p90_ms"]
    out["target"] = {"limit_ms": limit, "ours_p90_ms": ours, "ratio": ours / limit,
                     "met": ours <= limit}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _table(out)
    return Outcome(out, 1 if args.check and not out["target"]["met"] else 0)


def _table(out: dict[str, Any]) -> None:
    print(f"reads of {out['read_pages']} pages of {out['page_bytes'] >> 10} KiB beside "
          f"{out['write_batch']}-page write batches, {out['seconds']:g} s per phase, in "
          f"{out['dir']}")
    print(f"{'':36} {'p50 ms':>8} {'p90 ms':>8} {'reads':>6} {'writer GB/s':>12}")
    for key, name in (("raw", "raw drive" + ("" if out["raw"]["o_direct"] else " (buffered)")),
                      ("offload", "offload backend (cpu path)")):
        for phase, what in (("alone", "alone"), ("beside", "beside writes")):
            r = out[key][phase]
            gbps = f"{r['writer_gbps']:12.2f}" if "writer_gbps" in r else ""
            print(f"{name + ', ' + what:36} {r['p50_ms']:8.1f} {r['p90_ms']:8.1f} "
                  f"{r['reads']:6d} {gbps}")
    o, t = out["offload"], out["target"]
    if o.get("writes_held") is not None:
        print(f"the store's write calls held back by a read {o['writes_held']}, commit rounds "
              f"that waited for reads {o['flushes_delayed']}")
    if o["read_misses"] or o["beside"]["write_refused_pages"]:
        print(f"read misses {o['read_misses']}, write-back pages refused "
              f"{o['beside']['write_refused_pages']}")
    print(f"target: ours beside writes p90 {t['ours_p90_ms']:.1f} ms <= 2 x raw beside writer + "
          f"20 ms = {t['limit_ms']:.1f} ms: {'met' if t['met'] else 'missed'} "
          f"(ratio {t['ratio']:.2f})")


def contend_figure(result: dict[str, Any], title: str | None = None) -> Any:
    """A `bench contend` result: p50 and p90 read latency per phase (bars), the target as a line."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    phases = [("raw", "alone", "raw alone"), ("raw", "beside", "raw beside writer"),
              ("offload", "alone", "ours alone"), ("offload", "beside", "ours beside write-back")]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for j, (q, color) in enumerate((("p50_ms", "C0"), ("p90_ms", "C1"))):
        xs = [i + j * 0.4 for i in range(len(phases))]
        ys = [float(result[k][p][q]) for k, p, _ in phases]
        bars = ax.bar(xs, ys, 0.4, label=q.replace("_ms", ""), color=color)
        ax.bar_label(bars, labels=[f"{y:.1f}" for y in ys], fontsize="x-small", padding=2)
    ax.axhline(result["target"]["limit_ms"], color="black", linestyle="--", linewidth=0.8,
               label="target for ours beside writes (p90)")
    ax.set_xticks([i + 0.2 for i in range(len(phases))], [n for _, _, n in phases])
    ax.set_ylabel("read latency (ms)")
    ax.legend(fontsize="small")
    ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title or f"sglang-offload bench contend: {result['read_pages']} pages of "
                 f"{result['page_bytes'] >> 10} KiB beside {result['write_batch']}-page writes")
    fig.tight_layout()
    return fig
