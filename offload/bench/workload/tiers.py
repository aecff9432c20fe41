"""The three L3 set-ups `bench workload` compares, each a real SGLang server with the same engine.

- `ours`: `sglang-offload launch --config FILE` as is (`LaunchedServer.start`): HiCache with the
  offload tier as L3.
- `file`: SGLang's stock `file` L3 (`HiCacheFile`, one file per page under a directory).
- `none`: HiCache's L1/L2 only, no L3.

`file` and `none` run the very command `launch` composes for the file (`offload.launch.compose
.prepare`: the same `sglang:` flags, the same device picks, the same environment) with only the
storage backend flags swapped, because `launch` refuses any storage backend but its own. So the
three differ in the L3 and in nothing else. `StartedTier.blocks()` counts what the L3 holds
(store blocks, the file backend's files, 0 for none), to wait for a write-back before a restart;
`usage()` the blocks and their bytes.
`not_loaded(metrics_text)`: the tokens an L3 held that SGLang did not load, by reason, from its
`sglang:storage_prefetch_unfulfilled_tokens_total` (the servers run with `--enable-metrics`):
`host_capacity` is a storage hit trimmed because the L2 host pool had no room for all of it (the
rest is recomputed), the same for every L3.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from offload.launch.server import LaunchedServer, store_usage

TIERS = ("none", "file", "ours")
UNFULFILLED = "sglang:storage_prefetch_unfulfilled_tokens_total"
BACKEND_FLAGS = ("--hicache-storage-backend", "--hicache-storage-backend-extra-config")
STORAGE_NAMES = {"none": "no L3", "file": "SGLang file L3", "ours": "offload L3"}


def swap_backend(argv: list[str], tier: str, directory: Path,
                 extra: dict[str, object] | None = None) -> list[str]:
    """`launch`'s SGLang argv with its storage backend flags replaced by the tier's (`none`:
    none at all; `file`: SGLang's file backend under `directory`, SGLang's own extra-config
    keys of the deployment file kept)."""
    out: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        if token in BACKEND_FLAGS:
            skip = True
            continue
        if token.split("=", 1)[0] in BACKEND_FLAGS:
            continue
        out.append(token)
    if tier == "file":
        config = {**(extra or {}), "file_storage_path": str(directory)}
        out += ["--hicache-storage-backend", "file",
                "--hicache-storage-backend-extra-config", json.dumps(config)]
    return out


@dataclass
class StartedTier:
    tier: str
    server: LaunchedServer
    l3: Path                      # the store (ours), the file backend's directory, or unused
    first_request_s: float | None = None      # the warm-up request's TTFT (set by the bench)

    def blocks(self) -> int:
        if self.tier == "ours":
            return store_usage(self.l3)[0]
        if self.tier == "file":
            return sum(1 for _ in self.l3.glob("*.bin")) if self.l3.is_dir() else 0
        return 0

    def usage(self) -> tuple[int, int]:
        """(blocks, bytes) the L3 holds: the store's own books (ours), the file backend's files
        and their sizes, (0, 0) for none."""
        if self.tier == "ours":
            return store_usage(self.l3)
        if self.tier == "file" and self.l3.is_dir():
            sizes = [p.stat().st_size for p in self.l3.glob("*.bin")]
            return len(sizes), sum(sizes)
        return 0, 0

    def settle(self, quiet_s: float = 3.0, timeout: float = 180.0) -> int:
        """Wait until the L3's block count stops growing (the write-back landed); the count."""
        deadline = time.monotonic() + timeout
        last, since = self.blocks(), time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
            time.sleep(0.5)
            now = self.blocks()
            if now != last:
                last, since = now, time.monotonic()
        return last


def not_loaded(metrics_text: str) -> dict[str, int]:
    """Tokens of storage hits SGLang did not load, from its Prometheus text: `total`, and
    `host_capacity` (the hit trimmed to the L2 room); summed over ranks."""
    out = {"total": 0, "host_capacity": 0}
    for line in metrics_text.splitlines():
        if not line.startswith(UNFULFILLED + "{"):
            continue
        labels, _, value = line.rpartition("}")
        try:
            n = int(float(value.strip()))
        except ValueError:
            continue
        out["total"] += n
        if 'reason="host_capacity"' in labels:
            out["host_capacity"] += n
    return out


def tier_command(tier: str, config: Path, l3: Path) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of a baseline tier's server (`none`, `file`): launch's command with
    the storage backend swapped. The `file` L3 waits for a prefetch as ours does: launch's wait
    keys (`prefetch_timeout_*`), then the user's own extra-config keys."""
    from offload.launch.compose import prepare

    plan = prepare(str(config))
    extra = {**plan.device.extra_config, **plan.sglang.extra_config}
    return swap_backend(plan.argv, tier, l3, extra), dict(plan.device.env)


def start(tier: str, config: Path, l3: Path, log: Path, url: str) -> StartedTier:
    """Start the tier's server from the deployment file `config` (which names `l3` as its store
    for `ours`; `file` writes under `l3`). Not waited for: `server.wait_ready`."""
    if tier == "ours":
        return StartedTier(tier, LaunchedServer.start(config, log, url), l3)
    argv, env = tier_command(tier, config, l3)
    with open(log, "ab") as out:
        out.write(f"bench workload: tier {tier}: {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, **env})
    return StartedTier(tier, LaunchedServer(url.rstrip("/"), proc, log), l3)
