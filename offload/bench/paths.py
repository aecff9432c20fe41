"""`sglang-offload bench paths`: GB/s of each transfer path beside its baselines, same run.

For each block size (2-16 MiB): raw O_DIRECT disk bandwidth (`rawdisk`), NIXL's own loopback
bandwidth (a second process READs / WRITEs this process's registered memory with nothing else in
the way; one such call before each call of the dpu path, the same bytes, so that a shared
machine's load weighs on the path and its baseline alike), then
- cpu: `CpuStagingPath` over a `DiskStore` (ratio to raw disk);
- dpu: `AgentStore` against a real agent process on loopback (UCX), with the agent's store in DRAM
  (ratio to NIXL loopback: the protocol's overhead) and on disk (ratio to raw disk);
- gds: only where CUDA, kvikio and the store's slots are there (else reported as skipped).
Puts are timed until durable (the last put's commit waited for: `flush`), as raw disk syncs.
Host CPU seconds per GB moved (time.process_time of this process, all its threads) for cpu vs
dpu: the point of the DPU path is that the host CPU copies nothing. Each block size is measured
`--repeat` times, baselines and paths alternating, and the medians are reported.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from offload import argtypes
from offload.bench.common import JSON, Args, Option, Outcome, median_of, timed_cpu
from offload.config import Size, StoreConfig, format_size
from offload.store.base import flush as store_flush

SIZES = (2 << 20, 4 << 20, 8 << 20, 16 << 20)

OPTIONS = (
    Option(("--dir",), "cache directory on the disk to measure (default: a temporary directory "
           "under $TMPDIR)", None, argtypes.work_dir),
    Option(("--total",), "bytes moved per path and block size", "512MiB", argtypes.size),
    Option(("--sizes",), "block sizes, comma separated", ",".join(format_size(s) for s in SIZES),
           argtypes.size_list),
    Option(("--batch",), "blocks per put/get call", 8, argtypes.count),
    Option(("--paths",), "paths to measure", "cpu,dpu,gds", argtypes.names("cpu", "dpu", "gds")),
    Option(("--repeat",), "alternating tries per block size (medians reported)", 3, argtypes.count),
    JSON,
)


def measure(store: Any, size: int, total: int, batch: int, buf: memoryview, tag: bytes,
            beside: "Loopback | None" = None) -> dict[str, Any]:
    """Put then get `total` bytes in calls of `batch` blocks; GB/s and host CPU s/GB. Puts are
    timed until durable: a store that commits in the background (`flush`: the disk store, the
    agent's disk store) is flushed after the last put, inside the put time. With `beside`, each
    timed call follows one call of that baseline moving the same bytes (its GB/s are returned
    as `beside`): the load of a shared machine then weighs on both alike."""
    rounds = max(1, total // (size * batch))
    blocks = [[buf[i * size:(i + 1) * size]] for i in range(batch)]
    keys = [[tag + r.to_bytes(8, "big") + i.to_bytes(8, "big") + bytes(16 - len(tag))
             for i in range(batch)] for r in range(rounds)]
    # Warm-up (not timed, as for the NIXL baseline): connections, staging, UCX wire-up.
    warm = [b"warmup" + i.to_bytes(26, "big") for i in range(batch)]
    store.put_many(warm, blocks)
    store.get_many(warm, blocks)
    store.delete_many(warm)
    wall = {"put": 0.0, "get": 0.0}
    cpu = {"put": 0.0, "get": 0.0}
    base = {"put": 0.0, "get": 0.0}
    failed = 0
    for op, fn in (("put", store.put_many), ("get", store.get_many)):
        for r in range(rounds):
            if beside is not None:
                base[op] += beside.round(op)
            w, c, flags = timed_cpu(lambda: fn(keys[r], blocks))
            wall[op] += w
            cpu[op] += c
            failed += not all(flags)
        if op == "put":   # time to durable: the store's background commits count too
            w, c, done = timed_cpu(lambda: store_flush(store))
            wall[op] += w
            cpu[op] += c
            failed += not done
    gb = rounds * batch * size / 1e9
    out: dict[str, Any] = {"put_gbps": gb / wall["put"], "get_gbps": gb / wall["get"],
           "cpu_s_per_gb": (cpu["put"] + cpu["get"]) / (2 * gb), "failed_calls": failed}
    if beside is not None:
        out["beside"] = {"put_gbps": gb / base["put"], "get_gbps": gb / base["get"]}
    return out


def nixl_peer_main() -> None:
    """The loopback baseline's other process: for each line "put" / "get" on stdin, one READ /
    WRITE of the host's `batch` blocks, its seconds printed."""
    from offload.agent import nixl_util

    req = json.loads(sys.stdin.readline())
    agent = nixl_util.make_agent(f"bench-peer-{os.getpid()}")
    peer = agent.add_remote_agent(bytes.fromhex(req["md"]))
    size, batch = req["size"], req["batch"]
    local = mmap.mmap(-1, size * batch)
    base, _ = nixl_util.region_of(local)
    agent.register_memory([(base, size * batch, 0, "")], "DRAM")
    ldesc = [(base + i * size, size) for i in range(batch)]
    rdesc = [(req["addr"] + i * size, size) for i in range(batch)]
    for op in ("READ", "WRITE"):
        nixl_util.run_xfer(agent, op, ldesc, rdesc, peer, time.monotonic() + 60)   # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        op = {"put": "READ", "get": "WRITE"}[line.strip()]
        t0 = time.perf_counter()
        ok = nixl_util.run_xfer(agent, op, ldesc, rdesc, peer, time.monotonic() + 60)
        print(time.perf_counter() - t0 if ok else -1.0, flush=True)


class Loopback:
    """NIXL's own loopback bandwidth, a call at a time: a second process READs (put) / WRITEs
    (get) `batch` blocks of this process's registered memory with nothing else in the way."""

    def __init__(self, buf: memoryview, size: int, batch: int):
        from offload.agent import nixl_util

        self._agent = nixl_util.make_agent(f"bench-host-{os.getpid()}-{time.monotonic_ns()}")
        addr, n = nixl_util.region_of(buf)
        self._reg = self._agent.register_memory([(addr, n, 0, "")], "DRAM")
        code = "from offload.bench.paths import nixl_peer_main; nixl_peer_main()"
        self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._in, self._out = self._proc.stdin, self._proc.stdout
        self._in.write(json.dumps({"md": self._agent.get_agent_metadata().hex(), "addr": addr,
                                   "size": size, "batch": batch}) + "\n")
        self._in.flush()
        if self._out.readline().strip() != "ready":
            self.close()
            raise RuntimeError("the NIXL loopback peer did not start")

    def round(self, op: str) -> float:
        """Seconds of one call's worth of bytes moved for `op` ("put" or "get")."""
        self._in.write(op + "\n")
        self._in.flush()
        t = float(self._out.readline() or -1)
        if t < 0:
            raise RuntimeError(f"NIXL loopback {op} failed")
        return t

    def close(self) -> None:
        try:
            self._in.close()
            self._proc.wait(20)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
        self._agent.deregister_memory(self._reg)


class Agent:
    """A real agent process for the dpu path."""

    def __init__(self, args: list[str], secret: str, tmp: str):
        ready = os.path.join(tmp, f"ready-{time.monotonic_ns()}")
        env = dict(os.environ, SGLANG_OFFLOAD_SECRET=secret)
        env.setdefault("UCX_MODULES", "^ib")
        self.proc = subprocess.Popen([sys.executable, "-m", "offload.cli", "agent", "--listen",
                                      "127.0.0.1:0", "--ready-file", ready, *args], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 60
        while not os.path.exists(ready):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError("the agent did not start")
            time.sleep(0.05)
        with open(ready) as f:
            self.address = f"127.0.0.1:{f.read()}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run(args: Args) -> Outcome:
    os.environ.setdefault("UCX_MODULES", "^ib")
    sizes = [int(Size.parse(s)) for s in args.sizes.split(",") if s]
    total = int(Size.parse(args.total))
    paths = set(args.paths.split(","))
    from offload.bench.rawdisk import raw_bandwidth

    results: dict[str, Any] = {"total_bytes": total, "batch": args.batch, "sizes": {}}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        buf_map = mmap.mmap(-1, max(sizes) * args.batch)
        buf_map.write(os.urandom(1 << 20) * (len(buf_map) >> 20))
        buf = memoryview(buf_map)
        for size in sizes:
            tries = []  # alternating tries (baselines and paths), medians reported: disks drift
            for _ in range(args.repeat):
                row: dict[str, Any] = {}
                w, r = raw_bandwidth(tmp, total, size)
                row["raw_disk"] = {"put_gbps": w, "get_gbps": r}
                if "cpu" in paths:
                    row["cpu"] = _cpu(tmp, size, total, args.batch, buf)
                if "dpu" in paths:
                    row.update(_dpu(tmp, size, total, args.batch, buf))
                if "gds" in paths:
                    row["gds"] = {"skipped": _gds_skip_reason()}
                tries.append(row)
            results["sizes"][format_size(size)] = median_of(tries)
    _ratios(results)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        _table(results)
    return Outcome(results)


def _cpu(tmp: str, size: int, total: int, batch: int, buf: memoryview) -> dict[str, float]:
    from offload.store.disk.store import DiskStore
    from offload.transfer.cpu_staging import CpuStagingPath

    d = tempfile.mkdtemp(prefix=f"cpu-{size}-", dir=tmp)  # a fresh store for every try
    path = CpuStagingPath(DiskStore(StoreConfig(path=d, capacity=Size(2 * total + (64 << 20)),
                                                min_free=Size(0))))
    try:
        return measure(path, size, total, batch, buf, b"cpu")
    finally:
        path.close()
        shutil.rmtree(d, ignore_errors=True)


def _dpu(tmp: str, size: int, total: int, batch: int, buf: memoryview) -> dict[str, Any]:
    from offload.agent.client import AgentStore

    out: dict[str, Any] = {}
    try:
        loopback = Loopback(buf, size, batch)
    except Exception as e:  # noqa: BLE001 - a benchmark reports what it could not measure
        return {"dpu": {"skipped": f"NIXL loopback failed: {e}"}}
    secret = os.urandom(16).hex()
    staging = str(max(64 << 20, 4 * size))
    try:
        for name, store_args in (("dpu", ["--memory", "--capacity", str(2 * total + (1 << 30)),
                                          "--memory-reserve", str(2 * total)]),
                                 ("dpu_disk", ["--store", tempfile.mkdtemp(
                                     prefix=f"agent-{size}-", dir=tmp),
                                     "--capacity", str(2 * total + (64 << 20))])):
            agent = Agent([*store_args, "--staging", staging], secret, tmp)
            client = AgentStore(agent.address, secret.encode(), timeout_s=120)
            try:
                client.register_region(buf)
                # dpu: NIXL loopback a call at a time beside each call (its baseline).
                out[name] = measure(client, size, total, batch, buf, b"dpu",
                                    loopback if name == "dpu" else None)
                out[name]["nixl_bytes"] = client.stats().extra.get("agent_bytes_nixl_in", 0)
                if "beside" in out[name]:
                    out["nixl_loopback"] = out[name].pop("beside")
            finally:
                client.close()
                agent.stop()
    finally:
        loopback.close()
    return out


def _gds_skip_reason() -> str:
    try:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA GPU"
        import kvikio  # noqa: F401
    except ImportError as e:
        return f"not installed: {e.name}"
    return "run on a GDS host with the store's slots API (see the README: Transfer paths)"


def _ratios(res: dict[str, Any]) -> None:
    for row in res["sizes"].values():
        for path, base in (("cpu", "raw_disk"), ("dpu", "nixl_loopback"),
                           ("dpu_disk", "raw_disk")):
            if path in row and base in row and "put_gbps" in row[path]:
                for op in ("put", "get"):
                    row[path][f"{op}_ratio"] = row[path][f"{op}_gbps"] / row[base][f"{op}_gbps"]
        if "put_gbps" in row.get("cpu", {}) and "put_gbps" in row.get("dpu", {}):
            row["host_cpu_dpu_over_cpu"] = (row["dpu"]["cpu_s_per_gb"] /
                                            max(row["cpu"]["cpu_s_per_gb"], 1e-9))


def _table(res: dict[str, Any]) -> None:
    print(f"bench paths: {format_size(res['total_bytes'])} per path and size, {res['batch']} "
          "blocks per call; GB/s put/get (ratio to its baseline); host CPU s per GB")
    for size, row in res["sizes"].items():
        print(f"\n{size} blocks")
        for name, r in row.items():
            if not isinstance(r, dict):
                print(f"  host CPU dpu/cpu: {r:.2f}")
            elif "skipped" in r:
                print(f"  {name:14s} skipped: {r['skipped']}")
            else:
                line = f"  {name:14s} {r['put_gbps']:7.2f} / {r['get_gbps']:7.2f}"
                if "put_ratio" in r:
                    line += f"  ({r['put_ratio']:.2f}x / {r['get_ratio']:.2f}x)"
                if "cpu_s_per_gb" in r:
                    line += f"  cpu {r['cpu_s_per_gb']:.3f} s/GB"
                print(line)
