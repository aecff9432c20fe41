"""Which HiCache prefetch policy gives the fastest L3 hit on this device: measured, interleaved.

    .venv/bin/python scripts/prefetch_policy.py --config configs/cpu-dev.yaml --length 8192

One server started through `sglang-offload launch` (a private store and port in a scratch
directory). `--prompts` prompts are sent once (written back to the store). Then rounds: in each
round, for each policy (wait_complete, timeout, best_effort; the order rotates per round) the
policy is set at run time (SGLang's `PUT /hicache/storage-backend` with the server's admin key, a
random one per run; same backend: a policy update),
the device and host caches are emptied (`/flush_cache`), and the next stored prompt is sent: an
L3 hit, or less of one when the policy starts the prefill before the load is done. Prints per
policy the median time to first token and the cached tokens of its tries.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from offload.bench.serve import _prompt, deployment  # noqa: E402
from offload.bench.serve_target import SETTLE_S  # noqa: E402
from offload.launch.server import LaunchedServer, free_port, wait_store  # noqa: E402

POLICIES = ("wait_complete", "timeout", "best_effort")


def _flush(url: str, key: str) -> None:
    """Empty SGLang's device and host caches (`/flush_cache`, an admin call)."""
    req = urllib.request.Request(url + "/flush_cache", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


def _put_policy(url: str, policy: str, key: str) -> None:
    body = json.dumps({"hicache_storage_backend": "dynamic",
                       "hicache_storage_prefetch_policy": policy}).encode()
    req = urllib.request.Request(url + "/hicache/storage-backend", data=body, method="PUT",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        answer = r.read().decode()
    if r.status != 200:
        raise RuntimeError(f"policy {policy}: {answer}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    n_prompts = args.rounds * len(POLICIES)
    with tempfile.TemporaryDirectory(prefix="prefetch-policy-") as work_dir:
        work = Path(work_dir)
        seed = int(time.time())
        prompts = [_prompt(args.length, seed + 7919 * k) for k in range(n_prompts)]
        key = secrets.token_hex(16)      # SGLang takes a policy change only with its admin key
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = LaunchedServer.start(deployment(args.config, work / "store", port,
                                                 {"admin-api-key": key}), work / "server.log", url)
        got: dict[str, list[tuple[float, int]]] = {p: [] for p in POLICIES}
        try:
            server.wait_ready(900)
            server.generate(_prompt(512, seed - 1), 8)
            for ids in prompts:
                server.generate(ids, 8)
            wait_store(work / "store", (args.length - 1) // 64 * n_prompts, 300)
            _flush(url, key)
            server.generate(_prompt(512, seed - 1), 8)     # the first L3 load's one-off costs
            k = 0
            for r in range(args.rounds):
                order = POLICIES[r % 3:] + POLICIES[:r % 3]
                for policy in order:
                    _put_policy(url, policy, key)
                    _flush(url, key)
                    time.sleep(SETTLE_S)
                    reply = server.generate(prompts[k], 8)
                    k += 1
                    got[policy].append((reply.ttft_s, reply.cached_tokens))
                    print(f"round {r + 1} {policy}: {reply.ttft_s:.3f} s, cached "
                          f"{reply.cached_tokens} {reply.details}", flush=True)
        finally:
            server.stop()
    print(f"\n{args.length}-token prompts, {args.rounds} interleaved rounds:")
    for policy in POLICIES:
        tries = got[policy]
        print(f"{policy:<14} first token median {statistics.median(t for t, _ in tries):.3f} s, "
              f"cached {[c for _, c in tries]}, tries {[round(t, 3) for t, _ in tries]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
