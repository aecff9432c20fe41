"""Where an L3 hit's time goes: py-spy samples of a real server during L3 hits after a restart,
and during the L1/L2 hits of the same prompts right after, grouped by stage.

    .venv/bin/python scripts/l3_profile.py --config configs/cpu-dev.yaml --length 16384 --repeat 3

Needs py-spy (`.venv/bin/pip install py-spy`) and ptrace rights over the server (root, or
kernel.yama.ptrace_scope=0). Starts the server through `sglang-offload launch` (a private store
and port in a scratch directory), sends `--repeat` prompts, waits for their write-back, empties
SGLang's device and host caches (`/flush_cache`: what a restart leaves, without the restart),
then runs `py-spy record --subprocesses --format raw` (on-CPU samples of every thread of every
SGLang process) while the L3 hits go, and again while the same prompts go once more (L1/L2 hits).
Prints per phase the requests' times to first token and the CPU seconds per stage (samples /
rate; a sample is put in the first stage whose pattern a frame of its stack matches), so the L3
phase's extra CPU per stage is the difference of the two columns. Idle waits (a policy's polling
sleep, a queue) take no CPU: they are the part of the first-token gap the stages do not explain.
"""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from offload.bench.serve import _prompt  # noqa: E402
from offload.bench.serve_target import private_server  # noqa: E402
from offload.launch.server import wait_store  # noqa: E402

# stage -> frame pattern (function name or file), first match wins
STAGES = [
    ("store read: checksum", r"crc|checksum|xxh|blake|verify"),
    ("store read: disk", r"preadv?|_read_run|read_into|os\.read"),
    ("store read: other (batch_get_v1)", r"batch_get_v1|read_pages"),
    ("lookup: batch_exists / exists_many", r"batch_exists|exists_many|_storage_hit_query"),
    ("hashing of the prompt's pages", r"hash"),
    ("host -> device copies (load_back)", r"load_to_device|load_back|torch_transfer|copy_rows"),
    ("model forward (prefill of the tail)", r"forward_extend|forward_batch_generation|"
                                            r"run_batch|\bforward\b"),
    ("prefetch scheduling / polling", r"prefetch|check_prefetch_progress|_can_terminate"),
    ("scheduler loop, tokenizer, HTTP", r"scheduler|tokeniz|event_loop|uvicorn|zmq|recv_"),
]


def _stage(stack: str) -> str:
    for name, pattern in STAGES:
        if re.search(pattern, stack):
            return name
    return "other"


def _record(pid: int, rate: int, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--subprocesses", "--rate",
                             str(rate), "--format", "raw", "--output", str(out), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _stages(raw: Path, rate: int) -> Counter[str]:
    out: Counter[str] = Counter()
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            out[_stage(stack)] += int(n) / rate
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="l3-profile-") as work_dir:
        work = Path(work_dir)
        seed = int(time.time())
        prompts = [_prompt(args.length, seed + 7919 * k) for k in range(args.repeat)]
        server = private_server(args.config, work)
        try:
            server.wait_ready(900)
            server.generate(_prompt(512, seed - 1), 8)
            for ids in prompts:
                server.generate(ids, 8)
            wait_store(work / "store", (args.length - 1) // 64 * args.repeat + 7, 300)
            server.get("/flush_cache")                       # L1 and L2 empty: the store is L3
            server.generate(_prompt(512, seed - 1), 8)       # one-off costs of the first load
            assert server.proc is not None
            ttft: dict[str, list[float]] = {}
            cpu: dict[str, Counter[str]] = {}
            for phase in ("l3", "l1l2"):
                if phase == "l3":
                    server.get("/flush_cache")
                raw = work / f"{phase}.txt"
                spy = _record(server.proc.pid, args.rate, raw)
                time.sleep(2)
                t0 = time.perf_counter()
                ttft[phase] = [server.generate(ids, 8).ttft_s for ids in prompts]
                wall = time.perf_counter() - t0
                time.sleep(0.5)
                spy.send_signal(signal.SIGINT)
                spy.wait(60)
                cpu[phase] = _stages(raw, args.rate) if raw.exists() else Counter()
                print(f"{phase}: {len(prompts)} requests in {wall:.2f} s, first token "
                      f"median {statistics.median(ttft[phase]):.3f} s "
                      f"(tries {', '.join(f'{t:.3f}' for t in ttft[phase])})")
        finally:
            server.stop()
    print(f"\nCPU seconds per stage over {args.repeat} requests of {args.length} tokens "
          f"(py-spy, {args.rate} Hz, every SGLang process and thread):")
    print(f"{'stage':<40} {'L3 hits':>8} {'L1/L2':>8} {'extra':>8}")
    for name in [s for s, _ in STAGES] + ["other"]:
        a, b = cpu["l3"][name], cpu["l1l2"][name]
        print(f"{name:<40} {a:>8.3f} {b:>8.3f} {a - b:>8.3f}")
    a, b = sum(cpu["l3"].values()), sum(cpu["l1l2"].values())
    print(f"{'total':<40} {a:>8.3f} {b:>8.3f} {a - b:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
