"""SGLang's own benchmark client for `bench workload`: one run, its figures, and output agreement.

- `Workload`: the generated-shared-prefix workload (`groups` shared prefixes of `prefix` tokens,
  `users` conversations per prefix, `turns` turns of `question` new tokens and `output` generated
  tokens each, `concurrency` users in flight, `seed`); `unique`: instead as many single-turn
  requests, each a prompt of its own sent as token ids (`offload.bench.workload.unique`).
- `run_client(url, workload, out_file, work)`: `python -m sglang.benchmark.serving --backend
  sglang-oai-chat --dataset-name generated-shared-prefix --gsp-num-turns T --cache-report
  --output-details ...` against the server, in a child process (its output goes to a log beside
  `out_file`); its result: SGLang's own JSON line (TTFTs, throughput, generated texts, cached
  tokens and SGLang's breakdown of each request). Multi-turn runs replay each conversation round
  by round, the server's reply fed back as the assistant turn (SGLang's chat backend). The child
  runs with `HOME` in the work directory (SGLang's client caches generated prompts as a pickle
  under `~/.cache/sglang/benchmark`, keyed by the tokenizer's class, not its files: a stale one
  of another model would be loaded) and `HF_HUB_OFFLINE=1`: the tokenizer is the model's local
  one, named by the server's /model_info; nothing is downloaded.
- `summary(result, first, count)`: requests, failures, TTFT mean / p50 / p90 (ms), throughput
  and cached tokens by tier (device / host / storage) of a slice of the requests.
- `disagreements(reference, other, turns)`: per conversation, the first turn whose greedy text
  differs (later turns of that conversation follow from the difference, not counted apart).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offload.errors import RunError

CLIENT = "sglang.benchmark.serving"


@dataclass(frozen=True)
class Workload:
    groups: int
    users: int
    turns: int
    prefix: int
    question: int
    output: int
    concurrency: int
    seed: int
    unique: bool = False      # every request a prompt of its own (`offload.bench.workload.unique`)

    @property
    def conversations(self) -> int:
        return self.groups * self.users

    @property
    def requests(self) -> int:
        return self.conversations * self.turns


def client_argv(url: str, w: Workload, out_file: Path) -> list[str]:
    host, port = url.rsplit("//", 1)[-1].rsplit(":", 1)
    if w.unique:     # as many requests, each its own group of one single-turn prompt, as ids
        return [sys.executable, "-m", CLIENT, "--backend", "sglang", "--host", host,
                "--port", port, "--dataset-name", "generated-shared-prefix",
                "--gsp-num-groups", str(w.requests), "--gsp-prompts-per-group", "1",
                "--gsp-system-prompt-len", str(w.prefix), "--gsp-question-len", str(w.question),
                "--gsp-output-len", str(w.output), "--gsp-num-turns", "1",
                "--num-prompts", str(w.requests), "--max-concurrency", str(w.concurrency),
                "--seed", str(w.seed), "--warmup-requests", "0", "--cache-report",
                "--tokenize-prompt", "--output-file", str(out_file), "--output-details", "--disable-tqdm"]
    return [sys.executable, "-m", CLIENT, "--backend", "sglang-oai-chat", "--host", host,
            "--port", port, "--dataset-name", "generated-shared-prefix",
            "--gsp-num-groups", str(w.groups), "--gsp-prompts-per-group", str(w.users),
            "--gsp-system-prompt-len", str(w.prefix), "--gsp-question-len", str(w.question),
            "--gsp-output-len", str(w.output), "--gsp-num-turns", str(w.turns),
            "--num-prompts", str(w.conversations), "--max-concurrency", str(w.concurrency),
            "--seed", str(w.seed), "--warmup-requests", "0", "--cache-report",
            "--output-file", str(out_file), "--output-details", "--disable-tqdm"]


def client_env(home: Path) -> dict[str, str]:
    return {**os.environ, "HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "NO_PROXY": "127.0.0.1,localhost"}


def run_client(url: str, w: Workload, out_file: Path, home: Path, timeout: float) -> dict[str, Any]:
    """One run of SGLang's client; its result (the last JSON line it wrote)."""
    log = out_file.with_suffix(".log")
    out_file.unlink(missing_ok=True)
    with log.open("w") as out:
        try:
            rc = subprocess.run(client_argv(url, w, out_file), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=client_env(home), cwd=home,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
    if rc != 0 or not out_file.exists():
        what = "ran past its time limit" if rc is None else f"exited with {rc}"
        raise RunError(f"SGLang's client ({CLIENT}) {what} against {url}; its last lines:\n{tail}")
    lines = [ln for ln in out_file.read_text().splitlines() if ln.strip()]
    return json.loads(lines[-1])


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q                   # linear interpolation, as numpy's percentile
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """A run's figures: TTFT of the requests that succeeded, throughput, cached tokens by tier."""
    errors = result.get("errors") or []
    ok = [i for i, e in enumerate(errors) if not e]
    ttfts = [float(result["ttfts"][i]) * 1000 for i in ok]
    details = result.get("cached_tokens_details") or [None] * len(errors)
    cached = {"device": 0, "host": 0, "storage": 0}
    for i in ok:
        d = details[i] or {}
        for k in cached:
            cached[k] += int(d.get(k) or 0)
    prompt = sum(int(result["input_lens"][i] or 0) for i in ok)
    total = sum(int((result.get("cached_tokens") or [0] * len(errors))[i] or 0) for i in ok)
    r = lambda v: round(v, 1) if isinstance(v, (int, float)) else None   # noqa: E731
    return {"requests": len(errors), "failed": len(errors) - len(ok),
            "ttft_ms": {"mean": r(statistics.fmean(ttfts)) if ttfts else None,
                        "p50": r(_pct(ttfts, 0.5)), "p90": r(_pct(ttfts, 0.9))},
            "duration_s": round(float(result.get("duration") or 0), 2),
            "throughput": {"requests_per_s": round(float(result.get("request_throughput") or 0), 3),
                           "input_tokens_per_s": round(float(result.get("input_throughput") or 0), 1),
                           "output_tokens_per_s": round(float(result.get("output_throughput") or 0),
                                                        1)},
            "prompt_tokens": prompt, "cached_tokens": total, "cached_by_tier": cached,
            "hit_rate": round(total / prompt, 4) if prompt else 0.0,
            "storage_backend": next((str(d.get("storage_backend")) for d in details
                                     if d and d.get("storage")), None)}


def texts(result: dict[str, Any]) -> list[str | None]:
    """Each request's generated text (None where it failed), in SGLang's order: conversation by
    conversation, turn by turn."""
    errors = result.get("errors") or []
    return [None if errors[i] else t for i, t in enumerate(result.get("generated_texts") or [])]


def disagreements(reference: list[str | None], other: list[str | None], turns: int
                  ) -> list[tuple[int, int]]:
    """(conversation, turn) of each conversation's first turn whose text differs."""
    out = []
    for c in range(len(reference) // turns):
        for t in range(turns):
            i = c * turns + t
            if i >= len(other) or reference[i] != other[i]:
                out.append((c, t))
                break
    return out
