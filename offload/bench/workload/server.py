"""A tier's server for `bench workload`: started (again where SGLang found too little free host
memory), warmed with one prompt of its own, and asked what it runs.

- `serve(args, tier, d, over, name)`: a `StartedTier`, ready and warm; its L3 under `d/l3`.
- `server_info(t)`: SGLang's /get_server_info.
- `Terminated`: raised by the SIGTERM handler `terminated` so every `finally` stops its servers.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from offload.bench.common import Args
from offload.bench.serve import deployment
from offload.bench.workload.tiers import StartedTier, start
from offload.errors import RunError
from offload.launch.server import free_port

WARM, WARM_SEED = 512, 7                 # tokens and seed of each server's warm-up prompt
HOST_MEMORY = "Not enough host memory available"      # SGLang's refusal to size its L2 pool
START_TRIES, START_WAIT_S = 5, 30


class Terminated(RunError):
    """SIGTERM: unwinds through every `finally` (servers stopped), never retried."""


def terminated(signum: int, frame: object) -> None:
    raise Terminated("bench workload: terminated (SIGTERM); its servers are stopped")


def server_info(t: StartedTier) -> dict[str, Any]:
    """SGLang's /get_server_info ({} where it does not answer)."""
    try:
        info = json.loads(t.server.get("/get_server_info"))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def describe(info: dict[str, Any], *more: str) -> dict[str, Any]:
    """What a run's report says of its server, from its /get_server_info (plus `more` keys)."""
    return {k: info.get(k) for k in ("model_path", "device", "attention_backend", "page_size",
                                     "max_total_num_tokens", "hicache_ratio", *more)}


def serve(args: Args, tier: str, d: Path, over: dict[str, Any], name: str) -> StartedTier:
    """Start (and wait for) a tier's server in `d` (its L3 under d/l3, kept across restarts)."""
    d.mkdir(exist_ok=True)
    for attempt in range(START_TRIES):
        port = free_port()
        cfg = deployment(args.config, d / "l3", port, sglang=over, name=f"{name}.yaml")
        t = start(tier, cfg, d / "l3", d / f"{name}.log", f"http://127.0.0.1:{port}")
        try:
            t.server.wait_ready(args.start_timeout)
            break
        except RunError as e:
            # SGLang keeps 10 GiB of host RAM free before it sizes the L2 pool: on a machine
            # others share, a start can find less for a while; wait and try again
            if (isinstance(e, Terminated) or HOST_MEMORY not in t.server.tail(200)
                    or attempt == START_TRIES - 1):
                print(f"--- {t.server.log} (last lines) ---\n{t.server.tail()}",
                      file=sys.stderr)
                t.server.stop()
                raise
            t.server.stop()
            print(f"  {tier}: SGLang found too little free host memory; trying again in "
                  f"{START_WAIT_S} s", file=sys.stderr)
            time.sleep(START_WAIT_S)
    try:
        # one short prompt of its own first: a server's first L3 request pays one-off costs
        # (SGLang loads its hash extension); sent before and after the restart, so after it the
        # L3 read path is warm too. Timed and reported (`first_request_s`), not in the figures.
        warm = [random.Random(WARM_SEED).randrange(10, 250) for _ in range(WARM)]
        t.first_request_s = round(t.server.generate(warm, 1).ttft_s, 3)
    except (RunError, OSError) as e:
        print(f"--- {t.server.log} (last lines) ---\n{t.server.tail()}", file=sys.stderr)
        t.server.stop()
        if isinstance(e, RunError):
            raise
        raise RunError(f"bench workload: the {tier} server at {t.server.url} failed: {e}") from None
    return t
