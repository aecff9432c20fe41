"""Measure the cold-vs-hit logprob spread that offload.agree.TOLERANCE must cover.

For one model (a local checkpoint), one server started through `sglang-offload launch` with
SGLang's `enable-fp32-lm-head` (the servers every agreement check runs against), and each prompt
length, `--prompts` prompts of exactly that many tokens, each asked
  cold  (nothing cached),
  l1    (the same again: SGLang's device pool),
  l2    (after two filler prompts pushed it out of the device pool: HiCache's host pool),
  l3    (after /flush_cache emptied L1 and L2: the offload store),
(l2 for the first `--l2-prompts` prompts of each length only, where given: its filler prefills
the whole L1),
greedy, `--new-tokens` tokens, with offload.agree.REQUEST (each token's logprob and top-5). Each
hit is compared with the cold reply (`offload.agree.compare` with an infinite tolerance: only the
spread is wanted); printed per length and tier: the hit's cached tokens by tier, the largest
|delta logprob| over chosen tokens and common top-k candidates, top-k set mismatches and whether
the tokens parted. The last line: the largest spread of the run. `--json FILE` keeps everything.

Prompts: `--text FILE ...` (a real model): chat prompts (the model's chat template) asking about a
slice of those files cut to the exact length; without it random token ids in [10, 250) (any
model, the demo's). Each run starts one server (L1 `--l1-tokens`, L2 4x, a private store in a
temporary directory) and stops it at the end. Example (docs/design/agreement.md):

  .venv/bin/python scripts/measure-tolerance.py --model /tmp/smol --text README.md docs/*.md \
      --lengths 512,1024,2048,4096 --prompts 2 --json /tmp/spread-smol.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload.agree import Answer, compare  # noqa: E402
from offload.launch.server import LaunchedServer, Reply, free_port, store_usage  # noqa: E402

PAGE = 64


def chat_prompts(model: str, files: list[str], length: int, count: int, seed: int
                 ) -> list[list[int]]:
    """`count` chat prompts of exactly `length` token ids: a question about a slice of `files`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text = "\n\n".join(Path(f).read_text(errors="replace") for f in files)
    words = tok(text, add_special_tokens=False)["input_ids"]
    def chat(doc: str) -> list[int]:
        text = tok.apply_chat_template(
            [{"role": "user", "content": "Read this document, then say in one sentence what it "
              f"is about.\n\n<doc>\n{doc}\n</doc>"}], add_generation_prompt=True,
            tokenize=False)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    frame = chat("")
    out = []
    r = random.Random(seed * 7 + length)
    for _ in range(count):
        body = length - len(frame)
        start = r.randrange(0, max(1, len(words) - body))
        doc = str(tok.decode(words[start:start + body]))
        ids = chat(doc)
        # the decode/encode round trip moves the count by a few: cut or pad the document part
        cut = len(ids) - len(frame) // 2          # inside the document, before its end
        while len(ids) > length:
            cut -= 1
            del ids[cut]
        while len(ids) < length:
            ids.insert(cut, words[r.randrange(len(words))])
        out.append(ids)
    return out


def id_prompts(length: int, count: int, seed: int) -> list[list[int]]:
    r = random.Random(seed * 1_000_003 + length)
    return [[r.randrange(10, 250) for _ in range(length)] for _ in range(count)]


def config(path: Path, model: str, store: Path, port: int, l1: int, context: int) -> Path:
    doc = {"sglang": {"model-path": model, "device": "cpu", "page-size": PAGE,
                      "context-length": context, "max-total-tokens": l1, "hicache-ratio": 4,
                      "enable-fp32-lm-head": True, "enable-cache-report": True,
                      "host": "127.0.0.1", "port": port},
           "offload": {"store": {"path": str(store), "capacity": "2GiB", "min_free": "256MiB",
                                 "io_threads": 2}}}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def quiet_store(store: Path, still_s: float = 3.0, timeout: float = 120.0) -> int:
    """Wait until the store's block count has not moved for `still_s` (write-backs done)."""
    deadline = time.monotonic() + timeout
    last, since = store_usage(store)[0], time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < still_s:
        time.sleep(0.5)
        now = store_usage(store)[0]
        if now != last:
            last, since = now, time.monotonic()
    return last


def push_out(server: LaunchedServer, l1: int, n: int, seed: int) -> None:
    """Push the last prompt (n tokens) out of the device pool (L1 tokens): one filler that fits
    in what it left free, then one of its size, which evicts the least recently used: it. (One
    filler of the whole L1 waits in SGLang's queue for ever: it never fits beside the prompt.)"""
    first = (l1 - n - 2 * PAGE) // PAGE * PAGE
    for k, size in enumerate((first, n + PAGE)):
        if size > 0:
            server.generate(id_prompts(size, 1, seed * 7 + k)[0], 1)


def row(cold: Reply, hit: Reply) -> dict[str, Any]:
    ag = compare(cold.answer, hit.answer, tolerance=math.inf)
    return {"cached": hit.cached_tokens, "details": {k: hit.details.get(k) for k in
                                                     ("device", "host", "storage")},
            "max_delta": ag.max_delta, "topk_mismatches": ag.topk_mismatches,
            "first_diff": ag.first_diff, "margin": ag.margin,
            "chosen_max_delta": _chosen(cold.answer, hit.answer, ag.first_diff),
            "worst": _worst(cold.answer, hit.answer, ag.first_diff)}


def _worst(a: Answer, b: Answer, first: int | None) -> dict[str, Any] | None:
    """Where the largest top-k |delta| is: position, the candidate's rank in the cold reply's
    top-k (0: its pick), its logprob cold and from the hit."""
    best: dict[str, Any] | None = None
    upto = len(a.ids) if first is None else first + 1
    for i in range(min(upto, len(a.top), len(b.top))):
        ranked = sorted(a.top[i], key=lambda t: -a.top[i][t])
        for t in a.top[i].keys() & b.top[i].keys():
            d = abs(a.top[i][t] - b.top[i][t])
            if best is None or d > best["delta"]:
                best = {"delta": d, "position": i, "rank": ranked.index(t),
                        "cold": a.top[i][t], "hit": b.top[i][t]}
    return best


def _chosen(a: Answer, b: Answer, first: int | None) -> float:
    upto = len(a.ids) if first is None else first
    return max((abs(x - y) for x, y in zip(a.logprobs[:upto], b.logprobs[:upto])), default=0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", nargs="*", default=[])
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--l1-tokens", type=int, default=0, help="default: largest length + 512")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--l2-prompts", type=int, default=None,
                    help="prompts per length that also get the L2 phase (its filler prefills "
                    "the whole L1: slow on a CPU); default all")
    ap.add_argument("--json", default=None, help="write everything here (after every prompt)")
    ap.add_argument("--log", default=None, help="the server's log (default: in the temporary "
                    "directory, removed at the end)")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    l1 = a.l1_tokens or max(lengths) + 512
    context = max(8192, max(lengths) + a.new_tokens + 64)
    context = min(context, json.loads((Path(a.model) / "config.json").read_text())
                  .get("max_position_embeddings", context))
    out: dict[str, Any] = {"model": a.model, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                  time.gmtime()),
                           "new_tokens": a.new_tokens, "l1_tokens": l1, "rows": []}
    with tempfile.TemporaryDirectory(prefix="measure-tolerance-") as tmp:
        work = Path(tmp)
        port = free_port()
        cfg = config(work / "deploy.yaml", a.model, work / "store", port, l1, context)
        server = LaunchedServer.start(cfg, a.log or work / "server.log",
                                      f"http://127.0.0.1:{port}")
        try:
            server.wait_ready(600)
            server.generate(id_prompts(256, 1, 99)[0], 2)            # warm-up
            for n in lengths:
                prompts = (chat_prompts(a.model, a.text, n, a.prompts, a.seed) if a.text
                           else id_prompts(n, a.prompts, a.seed))
                for k, ids in enumerate(prompts):
                    cold = server.generate(ids, a.new_tokens)
                    res = {"length": n, "prompt": k, "cold_cached": cold.cached_tokens,
                           "text": cold.text}
                    res["l1"] = row(cold, server.generate(ids, a.new_tokens))
                    if a.l2_prompts is None or k < a.l2_prompts:
                        push_out(server, l1, n, a.seed * 31 + n + k)
                        res["l2"] = row(cold, server.generate(ids, a.new_tokens))
                    quiet_store(work / "store")                     # the write-back landed
                    server.flush_l1_l2(120.0)
                    res["l3"] = row(cold, server.generate(ids, a.new_tokens))
                    server.flush_l1_l2(120.0)
                    out["rows"].append(res)
                    if a.json:
                        Path(a.json).write_text(json.dumps(out, indent=2))
                    print(json.dumps({k2: v for k2, v in res.items() if k2 != "text"}),
                          flush=True)
        finally:
            server.stop()
    worst = max((r[t]["max_delta"] for r in out["rows"] for t in ("l1", "l2", "l3") if t in r),
                default=0.0)
    out["max_delta"] = worst
    print(f"largest |delta logprob| cold vs hit over the run: {worst:.5f} nats")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
