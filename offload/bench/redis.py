"""`sglang-offload bench redis`: the Redis tier's set/get throughput beside raw Redis, same run.

For each block size (default 1, 4 and 8 MiB) it writes and reads the same blocks twice, in turns:
- raw: redis-py SET / GET of the bytes, no header, no checksum, pipelined `--batch` at a time;
- ours: `RedisStore.put_many` / `get_many` (header, MAC bound to the key verified, bytes copied
  into the caller's buffers), pipelined the same way.
It reports GB/s and ours/raw. With `redis-benchmark` installed it also prints that C client's
SET/GET figures for the same server and size (a ceiling, not the baseline: it is not Python).
With no `--url` it starts its own `redis-server` (no persistence) in a temporary directory.

On a server given with `--url` it leaves nothing behind: its own keys (`sglo-bench:raw:*` and the
tier's) are deleted after each size, and redis-benchmark's keys (`key:NNNNNNNNNNNN`, as many as
blocks) are deleted after it ran; redis-benchmark is skipped when keys of those names already
exist there (it would overwrite them). An unreachable server is one `error:` line (exit 1).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from offload import argtypes, redact
from offload.bench.common import Args, Option, Outcome, timed
from offload.config import Size, format_size, load_offload
from offload.errors import ConfigError, StoreError, UsageError

OPTIONS = (
    Option(("--url",), "Redis to measure, redis://HOST:PORT[/DB] (default: start a private "
           "redis-server); what the benchmark writes there is deleted at the end", metavar="URL"),
    Option(("--sizes",), "block sizes, comma-separated", "1MiB,4MiB,8MiB", argtypes.size_list),
    Option(("--total",), "bytes written per size and round", "256MiB", argtypes.size),
    Option(("--batch",), "blocks per pipelined batch", 8, argtypes.count),
    Option(("--rounds",), "rounds per size (best one is kept)", 3, argtypes.count),
    Option(("--min-ratio",), "exit 1 if ours/raw at 4MiB (set or get) is below this (the "
           "missed ratios are named)", None, argtypes.positive),
    Option(("--secret-file",), "measure authenticated values (GMAC) under this redis.secret_file "
           "(default: unauthenticated, key-bound XXH3 values)", metavar="FILE"),
    Option(("--json",), "print the results as JSON", flag=True),
)
log = logging.getLogger("offload.bench")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def private_redis() -> Iterator[str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise StoreError("redis-server is not installed (Debian: apt-get install redis-server); "
                         "or pass --url")
    with tempfile.TemporaryDirectory(prefix="sglo-bench-redis-") as d:
        port = _free_port()
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", d,
                                 "--save", "", "--appendonly", "no", "--loglevel", "warning"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), 0.2).close()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise StoreError(f"redis-server did not start on port {port}") from None
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(10)


def _rate(nbytes: int, fn: Callable[[], None]) -> float:
    return nbytes / timed(fn) / 1e9


def _measure(url: str, size: int, count: int, batch: int, rounds: int,
             secret_file: str | None = None) -> dict[str, Any]:
    import numpy as np


    store = _open(url, secret_file)
    client = store.link.run(lambda c: c, "bench")
    if client is None:
        store.close()
        raise StoreError(f"cannot reach {redact.url(url)}: {store.link.last_error}")
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(count)]
    keys = [os.urandom(32) for _ in range(count)]
    raw_keys = [b"sglo-bench:raw:" + k for k in keys]
    dests = [[bytearray(size)] for _ in range(count)]
    total = size * count
    spans = [range(i, min(i + batch, count)) for i in range(0, count, batch)]

    def raw_set() -> None:
        for sp in spans:
            pipe = client.pipeline(transaction=False)
            for i in sp:
                pipe.set(raw_keys[i], blocks[i])
            pipe.execute()

    def raw_get() -> None:
        for sp in spans:
            pipe = client.pipeline(transaction=False)
            for i in sp:
                pipe.get(raw_keys[i])
            if any(v is None for v in pipe.execute()):
                raise StoreError("raw GET missed a block it had just written")

    def our_set() -> None:
        for sp in spans:
            if not all(store.put_many([keys[i] for i in sp], [[blocks[i]] for i in sp])):
                raise StoreError(f"put_many failed: {store.link.last_error}")

    def our_get() -> None:
        for sp in spans:
            if not all(store.get_many([keys[i] for i in sp], [dests[i] for i in sp])):
                raise StoreError(f"get_many missed: {store.link.last_error}")

    best = {"raw_set": 0.0, "ours_set": 0.0, "raw_get": 0.0, "ours_get": 0.0}
    try:
        # Each side runs on an empty server (the other's blocks deleted first), in turns.
        sides = [("raw", raw_set, raw_get, lambda: client.delete(*raw_keys)),
                 ("ours", our_set, our_get, lambda: store.delete_many(keys))]
        for r in range(rounds):
            for name, put, get, clear in (sides if r % 2 == 0 else sides[::-1]):
                best[f"{name}_set"] = max(best[f"{name}_set"], _rate(total, put))
                best[f"{name}_get"] = max(best[f"{name}_get"], _rate(total, get))
                if name == "ours" and bytes(dests[-1][0]) != blocks[-1]:
                    raise StoreError("a block read back differs from the one written")
                clear()
    finally:
        store.delete_many(keys)
        client.delete(*raw_keys)
        store.close()
    return dict(block=size, blocks=count, **{k: round(v, 3) for k, v in best.items()},
                set_ratio=round(best["ours_set"] / best["raw_set"], 3),
                get_ratio=round(best["ours_get"] / best["raw_get"], 3))


def _open(url: str, secret_file: str | None) -> Any:
    """The tier on `url`, checked with a PING: an unreachable server is one StoreError line."""
    from offload.store.redis.store import RedisStore

    try:
        cfg = load_offload({"redis": {"url": url, "timeout_s": 30.0,
                                      **({"secret_file": secret_file} if secret_file else {})}})
        store = RedisStore(cfg.redis)       # reads the secret file
    except ConfigError as e:
        names = (("offload.redis.url", "--url"), ("offload.redis.secret_file", "--secret-file"))
        raise UsageError("\n".join(next((p.replace(k, flag, 1) for k, flag in names
                                          if p.startswith(k)), p) for p in e.problems)) from None
    quiet = logging.getLogger("offload.store.redis.store")
    level = quiet.level
    quiet.setLevel(logging.ERROR)       # the reason is in the error below, not in a warning too
    try:
        store.ping()
    except StoreError as e:
        store.close()
        raise StoreError(f"bench redis --url {redact.url(url)}: {str(e).rstrip('.')}; start the server "
                         "or fix --url") from None
    finally:
        quiet.setLevel(level)
    log.debug("bench redis: %s answers", redact.url(url))
    return store


def benchmark_keys(count: int) -> list[bytes]:
    """The keys `redis-benchmark -t set,get -r COUNT` writes: key:000000000000 ... (12 digits)."""
    return [b"key:%012d" % i for i in range(count)]


def _redis_benchmark(url: str, size: int, count: int, batch: int) -> dict[str, float] | None:
    """redis-benchmark's SET/GET GB/s on the same server, its keys deleted after; None when it is
    not installed, the URL needs TLS/cluster/a password, or keys of its names already exist."""
    import redis

    from offload.store.redis.link import parse_url

    exe = shutil.which("redis-benchmark")
    t = parse_url(url)
    if exe is None or t.cluster or t.tls or t.password:
        return None
    host, port = t.nodes[0]
    names = benchmark_keys(count)
    client = redis.Redis(host=host, port=port, db=t.db, socket_timeout=30)
    try:
        held = sum(client.exists(*names[i:i + 1000]) for i in range(0, count, 1000))
        if held:
            log.warning("bench redis: redis-benchmark skipped: %s already holds %d keys named "
                        "key:NNNNNNNNNNNN that it would overwrite", redact.url(url), held)
            return None
        try:
            out = subprocess.run([exe, "-h", host, "-p", str(port), "--dbnum", str(t.db),
                                  "-t", "set,get", "-d", str(size), "-n", str(count), "-c", "1",
                                  "-P", str(batch), "-r", str(count), "--csv"],
                                 capture_output=True, text=True, timeout=120).stdout
        except (OSError, subprocess.TimeoutExpired):
            return None
        finally:
            for i in range(0, count, 1000):
                client.delete(*names[i:i + 1000])
    except redis.exceptions.RedisError as e:
        log.warning("bench redis: redis-benchmark skipped: %s", e)
        return None
    finally:
        client.close()
    res: dict[str, float] = {}
    for line in out.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if len(cells) >= 2 and cells[0] in ("SET", "GET"):
            try:
                res[cells[0].lower()] = round(float(cells[1]) * size / 1e9, 3)
            except ValueError:
                continue
    return res or None


def run(args: Args) -> Outcome:
    sizes = [int(Size.parse(s)) for s in args.sizes.split(",") if s.strip()]
    total = int(args.total)
    with (private_redis() if args.url is None else _given(args.url)) as url:
        rows = []
        for size in sizes:
            count = max(args.batch, total // size)
            log.debug("bench redis: %s blocks x %d", format_size(size), count)
            row = _measure(url, size, count, args.batch, args.rounds, args.secret_file)
            row["redis_benchmark"] = _redis_benchmark(url, size, count, args.batch)
            rows.append(row)
    result = {"url": redact.url(url), "authenticated": bool(args.secret_file), "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"Redis tier vs raw redis-py on the same server ({redact.url(url)}), best of {args.rounds}, "
              f"batch {args.batch}, values "
              + ("authenticated (GMAC)" if args.secret_file else "key-bound (XXH3, no secret)"))
        print(f"{'block':>7} {'raw set':>9} {'ours set':>9} {'ratio':>6} "
              f"{'raw get':>9} {'ours get':>9} {'ratio':>6}   redis-benchmark set/get")
        for r in rows:
            rb = r["redis_benchmark"]
            tool = f"{rb.get('set', 0):.2f} / {rb.get('get', 0):.2f} GB/s" if rb else "-"
            print(f"{format_size(r['block']):>7} {r['raw_set']:>6.2f}GB/s {r['ours_set']:>5.2f}"
                  f"GB/s {r['set_ratio']:>6.2f} {r['raw_get']:>5.2f}GB/s {r['ours_get']:>5.2f}"
                  f"GB/s {r['get_ratio']:>6.2f}   {tool}")
    if args.min_ratio is not None:
        return Outcome(result, _check_min_ratio(rows, args.min_ratio))
    return Outcome(result)


def _check_min_ratio(rows: list[dict[str, Any]], floor: float) -> int:
    """1 (each missed ratio named on stderr) if ours/raw at 4 MiB is below `floor`, else 0."""
    at4 = [r for r in rows if r["block"] == 4 << 20]
    if not at4:
        print(f"error: --min-ratio {floor:g} is checked at 4MiB blocks: add 4MiB to --sizes",
              file=sys.stderr)
        return 1
    missed = [f"{op} ratio {r[f'{op}_ratio']:.2f} < {floor:g} at 4MiB" for r in at4
              for op in ("set", "get") if r[f"{op}_ratio"] < floor]
    for m in missed:
        print(f"error: --min-ratio: {m} (ours/raw)", file=sys.stderr)
    return 1 if missed else 0


@contextmanager
def _given(url: str) -> Iterator[str]:
    yield url
