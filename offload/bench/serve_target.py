"""`bench serve`'s L3 target: interleaved triples on the restarted server, the raw-disk read of
each prefix, and the verdict.

- `triple_prompts(n, seed, repeat)`: the fresh prompts of the restarted server's triples (never
  sent before the restart);
- `raw_read_s(directory, nbytes)`: seconds the raw disk under `directory` takes to read `nbytes`
  sequentially with O_DIRECT (`offload.bench.rawdisk`, 4 MiB reads), measured in the run;
- `verdict(l1l2_s, l3_s, raw_s)`: the issue-25 target, an L3 hit's first token at most the L1/L2
  hit's plus twice the raw read of its KV bytes plus 30 ms, with the limit and the slack;
- `settle(store, until_blocks)`: before the next timed request, wait until the last one's
  write-back is done: `until_blocks` blocks in the store (`store_blocks(store)` before the
  request plus its pages; None: no store to watch), then `SETTLE_S` more
  for SGLang's device -> host copy, which runs on the scheduler's thread after a prefill and
  would otherwise be paid by whatever request comes next;
- `agreement(replies, cold)`: each hit's reply against its prompt's cold one at the logprob
  (`offload.agree.compare`, the model's measured tolerance: `offload.agree.tolerance_for`): the
  worst verdict, the largest |delta logprob|, the top-k mismatches and each try's figures;
  `spread(rows, tolerance)`: the run's own largest |delta| cold vs L1/L2 and vs L3 beside the
  tolerance (a note where the L1/L2 spread alone exceeds it);
- `why_missed(row, tokens, log)`: why a missed L3 target was missed where the cause is known:
  the hit recomputed instead of loaded (the worth-it rule, `offload.hicache.worth_it`, whose line
  in the restarted server's log is quoted), or the prefill a hit saves is less than the load
  costs (a load cannot beat a cheap prefill); None otherwise;
- `has_patch(prefix)`: whether the SGLang this process imports was built with a patch of
  `patches/` (the wheel's OFFLOAD_PATCHES record), read without importing SGLang;
- `private_server(config, work)`: a server started from a deployment file through launch, on a
  free loopback port with a private store under `work` (the measuring scripts' set-up);
- `missing_for_serve(config)`: why `bench serve` cannot start a server from a deployment file
  here (SGLang not importable, its model neither a local directory nor in the Hugging Face cache:
  a machine without network), or None; scripts/gpu-proof.sh asks it before `bench serve`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import random
import re
import time
from pathlib import Path
from typing import Any

import yaml

from offload.agree import TOLERANCE, compare
from offload.bench.rawdisk import raw_bandwidth
from offload.launch.server import LaunchedServer, Reply, free_port, store_usage, wait_store

SLACK_S = 0.030       # the target's fixed allowance
SETTLE_S = 1.0        # after a request's write-back reached the store: SGLang's own host copy
CHUNK = 4 << 20       # raw read size (bytes)
TRIPLE_SEED = 104_729


def triple_prompts(length: int, seed: int, repeat: int) -> list[list[int]]:
    """`repeat` fresh prompts of `length` token ids in [10, 250), none sent before."""
    out = []
    for k in range(repeat):
        r = random.Random((seed + TRIPLE_SEED * (k + 1)) * 1_000_003 + length)
        out.append([r.randrange(10, 250) for _ in range(length)])
    return out


def raw_read_s(directory: str, nbytes: int) -> float:
    """Seconds to read `nbytes` from the raw disk under `directory` (O_DIRECT, sequential)."""
    total = max(CHUNK, -(-nbytes // CHUNK) * CHUNK)
    _write, read_gbs = raw_bandwidth(directory, total, chunk=CHUNK)
    return nbytes / (read_gbs * 1e9) if read_gbs > 0 else 0.0


def store_blocks(store: Path | None) -> int:
    """Blocks in `store` now (0 without one): what `settle` counts from."""
    return store_usage(store)[0] if store is not None else 0


def settle(store: Path | None, until_blocks: int) -> None:
    """Wait for the last request's write-back: `until_blocks` blocks in `store` (None: no store
    to watch), then SETTLE_S seconds."""
    if store is not None and until_blocks > 0:
        wait_store(store, until_blocks, timeout=120.0)
    time.sleep(SETTLE_S)


def verdict(l1l2_s: float, l3_s: float, raw_s: float) -> dict[str, Any]:
    limit = l1l2_s + 2 * raw_s + SLACK_S
    return {"l1l2_s": round(l1l2_s, 4), "l3_s": round(l3_s, 4), "raw_read_s": round(raw_s, 4),
            "limit_s": round(limit, 4), "l3_extra_s": round(l3_s - l1l2_s, 4),
            "met": l3_s <= limit}


def agreement(replies: list[Reply], cold: list[Reply], tolerance: float = TOLERANCE
              ) -> dict[str, Any]:
    """A phase's replies, each against the cold reply of the same prompt."""
    got = [compare(c.answer, r.answer, tolerance) for r, c in zip(replies, cold)]
    worst = next((v for v in ("different", "near-tie", "same") if any(g.verdict == v for g in got)),
                 "same")
    out: dict[str, Any] = {"verdict": worst,
                           "max_delta": round(max((g.max_delta for g in got), default=0.0), 5),
                           "topk_mismatches": sum(g.topk_mismatches for g in got),
                           "tolerance": tolerance, "tries": [g.as_dict() for g in got]}
    bad = [str(g) for g in got if not g.ok]
    if bad:
        out["why"] = bad
    return out


def spread(rows: dict[str, dict[str, Any]], tolerance: float = TOLERANCE) -> dict[str, Any]:
    """The run's own largest |delta logprob|: cold vs L1/L2 (both servers), cold vs L3."""
    def worst(phases: tuple[str, ...]) -> float | None:
        got = [row[p]["agreement"]["max_delta"] for row in rows.values() for p in phases
               if isinstance(row.get(p), dict) and "agreement" in row[p]]
        return max(got) if got else None

    out: dict[str, Any] = {"l1l2_max_delta": worst(("l1l2", "l1l2_restarted")),
                           "l3_max_delta": worst(("l3",)), "tolerance": tolerance}
    if (out["l1l2_max_delta"] or 0.0) > tolerance:
        out["note"] = ("this run's own cold-vs-L1/L2 spread exceeds the tolerance: re-measure "
                       "it on this machine (scripts/measure-tolerance.py)")
    return out


WORTH_IT_LINE = re.compile(r"offload: worth-it threshold [^\n]*")


def why_missed(row: dict[str, Any], tokens: int, log: Path) -> str | None:
    """Why the row's L3 target was missed, where the cause is known; None if met or unknown."""
    t = row.get("target") or {}
    if t.get("met", True):
        return None
    try:
        said = WORTH_IT_LINE.findall(log.read_text(errors="replace"))
    except OSError:
        said = []
    rule = f" (the restarted server's {said[-1]})" if said else ""
    storage = ((row.get("l3") or {}).get("cached_details") or {}).get("storage") or 0
    if not storage:
        return (f"the L3 hit was recomputed, not loaded (0 of {tokens} tokens from storage): the "
                f"worth-it rule skips a load slower than the prefill{rule}")
    cold = (row.get("cold_restarted") or {}).get("ttft_s")
    if isinstance(cold, (int, float)) and cold - t["l1l2_s"] <= t["l3_extra_s"]:
        return (f"a hit saves {1000 * (cold - t['l1l2_s']):.0f} ms of prefill here (cold "
                f"{cold:.3f} s - L1/L2 {t['l1l2_s']:.3f} s), less than the load adds "
                f"({1000 * t['l3_extra_s']:.0f} ms): a load cannot beat a prefill this cheap "
                f"(the worth-it rule, offload/hicache/worth_it.py){rule}")
    return None


def has_patch(prefix: str) -> bool | None:
    """True/False: the installed SGLang's record lists a patch starting with `prefix`; None: no
    record (not this distribution's wheel)."""
    try:
        record = importlib.metadata.distribution("sglang").read_text("OFFLOAD_PATCHES")
    except importlib.metadata.PackageNotFoundError:
        return None
    if record is None:
        return None
    return any(line.split()[-1].startswith(prefix) for line in record.splitlines()
               if line.strip() and not line.startswith("#"))


def missing_for_serve(config: str) -> str | None:
    """Why a server cannot start from `config` on this machine, or None (nothing is imported)."""
    if importlib.util.find_spec("sglang") is None:
        return "SGLang is not importable by this Python"
    try:
        doc = yaml.safe_load(Path(config).read_text())
        model = str(doc["sglang"]["model-path"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{config}: no sglang.model-path ({e})"
    if Path(model).is_dir():
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return f"model {model} is not a local directory and huggingface_hub is not installed"
    if isinstance(try_to_load_from_cache(model, "config.json"), str):
        return None
    return (f"model {model} is neither a local directory nor in the Hugging Face cache "
            "(no network here: copy the weights in, or point model-path at them)")


def private_server(config: str, work: Path, log: str = "server.log") -> LaunchedServer:
    """Start a server from `config` on a free loopback port, its store in `work`/store."""
    from offload.bench.serve import deployment

    port = free_port()
    return LaunchedServer.start(deployment(config, work / "store", port), work / log,
                                f"http://127.0.0.1:{port}")
