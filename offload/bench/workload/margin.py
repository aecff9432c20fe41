"""Is a greedy difference a near-tie of the model, or a real one? The top-2 logprob margin.

A random-weight model's next-token distribution is nearly flat: two candidates often lie within
bf16 rounding of each other, and a cached prefix (attention computed in another order, another
batch) can flip the greedy pick without anything being wrong. For each conversation's first turn
whose text differs from the reference, `margins` rebuilds that turn's messages (SGLang's own
generated-shared-prefix generator, same seed and tokenizer as its client: `conversations`),
asks a server for the reference's greedy continuation with `top_logprobs: 2`, and takes the margin
(top-1 minus top-2 logprob, nats) at the first token where the two texts part. A margin below
`--tie-margin` is a near-tie; above it, a real difference.
"""

from __future__ import annotations

import json
import random
import urllib.request
from pathlib import Path
from typing import Any

from offload.bench.workload.client import Workload


def conversations(model: str, w: Workload, scratch: Path) -> list[list[str]]:
    """Each conversation's user turns, exactly as SGLang's client built them for `w`."""
    import numpy as np
    from sglang.benchmark.datasets import generated_shared_prefix as gsp
    from sglang.benchmark.utils import get_tokenizer

    tokenizer = get_tokenizer(model)
    random.seed(w.seed)                    # what the client seeds before it builds the dataset
    np.random.seed(w.seed)
    cache = scratch / f"gsp-{w.seed}.pkl"  # its prompt cache, private here (never a stale one)
    cache.unlink(missing_ok=True)
    keep = gsp.get_gen_prefix_cache_path
    gsp.get_gen_prefix_cache_path = lambda *a, **k: cache
    try:
        rows = gsp.sample_generated_shared_prefix_requests(
            num_groups=w.groups, prompts_per_group=w.users, system_prompt_len=w.prefix,
            question_len=w.question, output_len=w.output, range_ratio=1.0, tokenizer=tokenizer,
            seed=w.seed, num_turns=w.turns)
    finally:
        gsp.get_gen_prefix_cache_path = keep
        cache.unlink(missing_ok=True)
    return [[r.prompt] if isinstance(r.prompt, str) else list(r.prompt) for r in rows]


def messages(turns: list[str], replies: list[str | None], upto: int) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    for t in range(upto + 1):
        out.append({"role": "user", "content": turns[t]})
        if t < upto:
            out.append({"role": "assistant", "content": replies[t] or ""})
    return out


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def margin_at(tokens: list[dict[str, Any]], split: int) -> float | None:
    """Top-1 minus top-2 logprob of the token that covers character `split` of the text."""
    pos = 0
    for tok in tokens:
        pos += len(tok.get("token") or "")
        if pos > split:
            top = sorted((float(c["logprob"]) for c in tok.get("top_logprobs") or []),
                         reverse=True)
            return round(top[0] - top[1], 4) if len(top) >= 2 else None
    return None


def probe(url: str, model_id: str, msgs: list[dict[str, str]], reference: str, other: str,
          max_tokens: int, timeout: float = 600.0) -> dict[str, Any]:
    """The margin where `reference` and `other` part, from the server's greedy continuation."""
    reply = _post(url + "/v1/chat/completions", {
        "model": model_id, "messages": msgs, "max_completion_tokens": max_tokens,
        "temperature": 0.0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2,
        "stream": False}, timeout)
    choice = reply["choices"][0]
    text = choice["message"].get("content") or ""
    split = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b),
                 min(len(reference), len(other)))
    tokens = (choice.get("logprobs") or {}).get("content") or []
    return {"margin": margin_at(tokens, split), "split_char": split,
            "probe_reproduces": text in (reference, other)}
