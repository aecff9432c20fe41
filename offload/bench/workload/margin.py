"""Is a greedy difference a near-tie of the model, or a real one? Judged at the logprob.

Two replies to one prompt part where the greedy pick differs. A cached prefix moves the logits by
a little (`offload.agree`: attention computed in another order, other matrix shapes), so where the
reference itself ranked the other's token within the model's measured tolerance
(`offload.agree.tolerance_for`) of its own, the
parting is a near-tie of the model; further apart, or the other's token not in its top-5, a real
difference. SGLang's benchmark client keeps each reply's text only (no logprobs), so a differing
turn is asked again here:

- `conversations(model, w, scratch)`: each conversation's user turns, exactly as SGLang's client
  built them (its own generated-shared-prefix generator, same seed and tokenizer: `load_tokenizer`);
  `messages`: one turn's chat so far; `prompt_ids(tokenizer, msgs)`: its token ids (the model's
  chat template).
- `judge(server, tokenizer, msgs, reference, other, max_tokens)`: on a server without L3, the
  turn asked cold (`/flush_cache` first) and again (an L1/L2 hit), greedy with
  `offload.agree.REQUEST`; the cold reply's margin where it parts from whichever of the two texts
  it did not reproduce (`parting`), the verdict, and the cold-vs-hit agreement of the re-ask (the
  run's measured |delta logprob| and top-k mismatches).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Protocol

from offload.agree import TOLERANCE, Answer, compare
from offload.bench.workload.client import Workload
from offload.launch.server import LaunchedServer


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


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


def load_tokenizer(model: str) -> Any:
    """The model's tokenizer, as SGLang's client loads it (local files only)."""
    from sglang.benchmark.utils import get_tokenizer

    return get_tokenizer(model)


def prompt_ids(tokenizer: Any, msgs: list[dict[str, str]]) -> list[int]:
    """The chat's token ids as SGLang's chat endpoint builds them (the model's template)."""
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def parting(tokenizer: Tokenizer, ans: Answer, text: str) -> tuple[int | None, float | None]:
    """(position, margin) where `ans` stops spelling `text`: the margin is `ans`'s logprob of its
    own token minus its logprob of the top-k candidate that spells `text` on (the likeliest, if
    several); None when none does. (None, None) where `ans` spells a prefix of `text` throughout."""
    def spelt(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    for i in range(len(ans.ids)):
        if text.startswith(spelt(ans.ids[:i + 1])):
            continue
        before = len(spelt(ans.ids[:i]))
        alts = [lp for c, lp in ans.top[i].items() if c != ans.ids[i]
                and len(spelt(ans.ids[:i] + [c])) > before
                and text.startswith(spelt(ans.ids[:i] + [c]))]
        return i, (ans.logprobs[i] - max(alts)) if alts else None
    return None, None


def judge(server: LaunchedServer, tokenizer: Any, msgs: list[dict[str, str]], reference: str,
          other: str, max_tokens: int, tolerance: float = TOLERANCE) -> dict[str, Any]:
    """A differing turn asked cold and again on `server` (no L3), judged at the logprob."""
    ids = prompt_ids(tokenizer, msgs)
    server.flush_l1_l2(120.0)
    cold = server.generate(ids, max_tokens, ignore_eos=True)
    hit = server.generate(ids, max_tokens, ignore_eos=True)
    again = compare(cold.answer, hit.answer, tolerance)
    spelt = tokenizer.decode(cold.answer.ids, skip_special_tokens=True)
    reproduces = "reference" if spelt == reference else "other" if spelt == other else None
    first, margin = parting(tokenizer, cold.answer, other if reproduces != "other" else reference)
    near = margin is not None and margin <= tolerance and again.ok
    return {"verdict": "near-tie" if near else "different",
            "margin": None if margin is None else round(margin, 5), "first_diff": first,
            "probe_reproduces": reproduces, "reask": again.as_dict()}
