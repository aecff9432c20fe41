"""Where an L3 hit's time goes: py-spy samples of a real server during L3 hits after a restart,
and during the L1/L2 hits of the same prompts right after, grouped by stage.

    .venv/bin/python scripts/l3_profile.py --config configs/cpu-dev.yaml --length 16384 --repeat 3

Needs py-spy (`.venv/bin/pip install py-spy`) and ptrace rights over the server (root, or
kernel.yama.ptrace_scope=0). Starts the server through `sglang-offload launch` (a private store
and port in a scratch directory), sends `--repeat` prompts, waits for their write-back, empties
SGLang's device and host caches (`/flush_cache`: what a restart leaves, without the restart),
then runs `py-spy record --subprocesses --idle --threads --format raw` (every thread of every
SGLang process, waiting or not) while the L3 hits go (one new token each: the window is the time
to first token), and again while the same prompts go once more (L1/L2 hits). Prints per phase the
requests' times to first token, and milliseconds per request by thread (the scheduler's thread is
the request's critical path; the prefetch query, I/O and ACK threads and the backup thread work
beside it) and stage (a sample goes to the first stage whose pattern its leaf-most frame matches;
a thread blocked in a queue, a lock or a sleep is "idle wait"), so the L3 column less the L1/L2
column is what the L3 path adds, stage by stage. `--keep DIR` keeps the raw samples and the log;
`--from DIR` tables kept samples again without a server.
"""

from __future__ import annotations

import argparse
import re
import shutil
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

# Threads by role (a frame of the thread's stack names its loop), then stages by frame pattern
# (first match wins, leaf-most frame first). The scheduler thread is the request's critical path.
ROLES = [
    ("scheduler", r"Scheduler\.run_event_loop|event_loop_(normal|overlap)"),
    ("prefetch query thread", r"prefetch_thread_func"),
    ("prefetch I/O thread", r"prefetch_io_aux_func"),
    ("prefetch ACK thread", r"prefetch_sync_thread_func"),
    ("backup thread", r"backup_thread_func"),
    ("store I/O workers", r"^_worker \(concurrent/futures/thread\.py"),
    ("HTTP / tokenizer", r"uvicorn|tokenizer_manager|TokenizerManager|asyncio"),
]
STAGES = [
    ("idle wait", r"^(Condition\.wait|Event\.wait|Queue\.get|select|poll|_poll|sleep|"
                  r"IdleSleeper\.maybe_sleep|Socket\.poll)\b"),
    ("store read: checksum", r"crc|checksum|xxh|blake|verify"),
    ("store read: index (locate, LRU touch)", r"Index\.|_flush_touches|\blocate\b"),
    ("store read: disk", r"preadv?\b|read_run|read_batch|read_into|os\.read"),
    ("store read: other", r"batch_get_v1|read_pages"),
    ("lookup: batch_exists / exists_many", r"batch_exists|exists_many"),
    ("hashing of the prompt's pages", r"get_native_hash|get_hash_str|get_storage_hash_str|"
                                      r"compute_node_hash"),
    ("host -> device copies", r"load_to_device|load_back|copy_rows_to_device"),
    ("device -> host copies (write-back)", r"backup_from_device|copy_rows_to_host"),
    ("model forward", r"forward_extend|forward_decode|forward_batch_generation|run_batch|"
                      r"Module\._call_impl"),
    ("prefetch scheduling / wait_complete polling",
     r"prefetch(?!_thread_func|_io_aux_func|_sync_thread_func)|check_hicache_events|_process_hicache_events|drain_storage|on_idle|"
     r"_sync_hicache_ready_counts|_count_ready_acks"),
    ("radix match / scheduling", r"match_prefix|get_next_batch_to_run|_get_new_batch_prefill|"
                                 r"schedule_policy|PrefillAdder"),
    ("request receive / output", r"ingest_requests|recv_|send_|process_batch_result|stream_output"),
]


def _classify(frames: list[str], table: list[tuple[str, str]]) -> str:
    for f in reversed(frames):                       # leaf first
        for name, pattern in table:
            if re.search(pattern, f):
                return name
    return "other"


def _record(pid: int, rate: int, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--subprocesses", "--rate",
                             str(rate), "--format", "raw", "--output", str(out), "--nonblocking",
                             "--idle", "--threads"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _stages(raw: Path, rate: int) -> Counter[tuple[str, str]]:
    """Seconds per (thread role, stage): every thread's samples, idle ones included."""
    out: Counter[tuple[str, str]] = Counter()
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        role = _classify(frames, ROLES)
        if role == "other":
            continue
        stage = _classify(frames, STAGES[1:])
        if re.search(dict(ROLES)[role], frames[-1]):             # the thread's own loop: idle
            stage = "idle wait"
        elif re.search(STAGES[0][1], frames[-1]):                # blocked: on what, if known
            stage = "idle wait" if stage in ("other", "request receive / output") else \
                f"{stage} (blocked)"
        out[(role, stage)] += int(n) / rate
    return out


def _table(cpu: dict[str, Counter[tuple[str, str]]], length: int, n: int, rate: int) -> None:
    print(f"\nmilliseconds per request of {length} tokens, by thread and stage (py-spy "
          f"--idle, {rate} Hz, {n} requests per phase, max_new_tokens 1):")
    print(f"{'thread':<24} {'stage':<44} {'L3 hits':>8} {'L1/L2':>8} {'extra':>8}")
    keys = sorted(set(cpu["l3"]) | set(cpu["l1l2"]))
    for role, _ in ROLES:
        for key in [k for k in keys if k[0] == role]:
            a, b = 1000 * cpu["l3"][key] / n, 1000 * cpu["l1l2"][key] / n
            if max(a, b) >= 0.5:
                print(f"{role:<24} {key[1]:<44} {a:>8.1f} {b:>8.1f} {a - b:>8.1f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config")
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--keep", metavar="DIR", help="copy the raw samples and the server log here")
    p.add_argument("--from", dest="source", metavar="DIR", help="no server: table the samples a "
                   "run kept with --keep DIR (give its --length, --repeat and --rate)")
    args = p.parse_args()
    if not args.source and not args.config:
        p.error("give --config FILE (or --from DIR)")
    if args.source:
        _table({ph: _stages(Path(args.source) / f"{ph}.txt", args.rate) for ph in ("l3", "l1l2")},
               args.length, args.repeat, args.rate)
        return 0
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
            cpu: dict[str, Counter[tuple[str, str]]] = {}
            for phase in ("l3", "l1l2"):
                if phase == "l3":
                    server.get("/flush_cache")
                raw = work / f"{phase}.txt"
                spy = _record(server.proc.pid, args.rate, raw)
                time.sleep(2)
                t0 = time.perf_counter()
                ttft[phase] = [server.generate(ids, 1).ttft_s for ids in prompts]
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
            if args.keep:
                Path(args.keep).mkdir(parents=True, exist_ok=True)
                for f in [*work.glob("*.txt"), *work.glob("*.log")]:
                    shutil.copy(f, Path(args.keep) / f.name)
    _table(cpu, args.length, args.repeat, args.rate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
