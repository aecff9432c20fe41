"""Do two greedy replies to one prompt agree? Compared at the logprob, within a measured tolerance.

A prefix served from a cache (L1/L2/L3) is computed in another order and with other matrix shapes
than the same prefix computed cold, so its logits move by a little even when every byte of KV is
right. "The same answer" therefore means: the same tokens, each chosen token's logprob and every
top-k candidate's within `TOLERANCE` nats of the reference's, up to the first token where the two
part (after it the contexts differ); a parting where the reference itself ranked the other's token
within `TOLERANCE` of its own pick is a near-tie of the model, not a fault.

Primitives:
- `REQUEST`: the `/generate` fields that ask SGLang for what `Answer` reads (merge them into the
  request body); `TOP_K` candidates per position.
- `Answer(ids, logprobs, top)`: a reply's generated tokens, each one's logprob and its top-k
  candidates; `Answer.from_meta(meta)` reads SGLang's `meta_info` (`output_token_logprobs`
  [[lp, id, text], ...], `output_top_logprobs` [[[lp, id, text], ...], ...]).
- `compare(ref, other, tolerance) -> Agreement`: the verdict ("same" | "near-tie" | "different"),
  the largest |delta logprob| compared, the top-k set mismatches, the first differing position and
  the reference's margin there; `Agreement.ok` is "not different".
- `Streamed`: a streamed `/generate` reply put together chunk by chunk (`add`), whichever way
  SGLang streams (every position so far, its default, or only the new ones with
  `--incremental-streaming-output`); `answer()` once the stream ended.
- `TOLERANCE`: measured, see its comment and docs/design/agreement.md; `tolerance_for(model_dir)`:
  `RANDOM_TOLERANCE` for the random-weight demo model (its config.json names it), else
  `TOLERANCE`.

SGLang must compute the lm head in float32 (`enable-fp32-lm-head: true`): in bf16 logprobs move
in steps of up to 0.125 nats and exact ties are common, so no tolerance tells a tie from a fault.
This module imports nothing of the rest of `offload`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TOP_K: int = 5

REQUEST: dict[str, Any] = {"return_logprob": True, "top_logprobs_num": TOP_K,
                           "logprob_start_len": -1,          # output positions only: no prefix cap
                           "return_text_in_logprobs": False}

# nats. Measured 2026-12-08 on the 2-core CPU VM (device cpu, torch_native attention, SGLang
# 0.5.23, enable-fp32-lm-head) with scripts/measure-tolerance.py: the largest |delta logprob|
# between a cold reply and the same prompt served from L1, L2 and L3, over chosen tokens and
# common top-5 candidates, 12-16 greedy tokens. SmolLM2-135M-Instruct (bf16, chat prompts of
# 512-4096 tokens, 50 hits of 23 prompts): up to 0.341 (a top-5 candidate; chosen tokens up to
# 0.105), no length trend (512: 0.177, 1K: 0.341, 2K: 0.191, 4K: 0.317); TOLERANCE is twice the
# largest, rounded up. The random-weight demo model (`demo-model --random`, token ids of
# 512-4096, 24 hits): 0.0 exactly, every tier and length; RANDOM_TOLERANCE is a floor for other
# CPUs' kernels, tight so that a check on it keeps its power (a random model's wrong KV moves
# its near-flat logprobs by little). `tolerance_for(model_dir)` picks. Method, figures, how to
# re-measure: docs/design/agreement.md.
TOLERANCE: float = 0.7
RANDOM_TOLERANCE: float = 0.01
RANDOM_MODEL = "sglang-offload-demo"      # the random-weight demo's config.json _name_or_path

VERDICTS = ("same", "near-tie", "different")


def tolerance_for(model_dir: str | Path | None) -> float:
    """The measured tolerance of the model in `model_dir`: `RANDOM_TOLERANCE` where its
    config.json is the random-weight demo's (`_name_or_path` RANDOM_MODEL), else `TOLERANCE`
    (also for a model that is not a readable local directory)."""
    if not model_dir:
        return TOLERANCE
    try:
        doc = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return TOLERANCE
    return RANDOM_TOLERANCE if isinstance(doc, dict) and doc.get("_name_or_path") == RANDOM_MODEL \
        else TOLERANCE


@dataclass(frozen=True)
class Answer:
    ids: list[int]                 # generated token ids
    logprobs: list[float]          # each generated token's logprob (nats)
    top: list[dict[int, float]]    # per generated position: top-k candidates, token id -> logprob

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> "Answer":
        """From SGLang's `/generate` meta_info of a request with `REQUEST`'s fields (the whole
        reply: a streamed reply's positions accumulated first, `offload.launch.server`). Raises
        ValueError when the logprobs are missing or malformed."""
        tokens = meta.get("output_token_logprobs")
        tops = meta.get("output_top_logprobs")
        if not isinstance(tokens, list) or not isinstance(tops, list):
            raise ValueError("meta_info has no output_token_logprobs / output_top_logprobs: ask "
                             "with offload.agree.REQUEST (return_logprob, top_logprobs_num)")
        if len(tops) != len(tokens):
            raise ValueError(f"meta_info: {len(tokens)} output_token_logprobs but {len(tops)} "
                             "output_top_logprobs")
        ids, lps, top = [], [], []
        for i, (tok, cands) in enumerate(zip(tokens, tops)):
            lp, tid = _entry(tok, f"output_token_logprobs[{i}]")
            ids.append(tid)
            lps.append(lp)
            if not isinstance(cands, list) or not cands:
                raise ValueError(f"meta_info output_top_logprobs[{i}]: no candidates (ask with "
                                 f"top_logprobs_num {TOP_K})")
            row: dict[int, float] = {}
            for j, c in enumerate(cands):
                clp, cid = _entry(c, f"output_top_logprobs[{i}][{j}]")
                if cid in row:
                    raise ValueError(f"meta_info output_top_logprobs[{i}]: token {cid} twice")
                row[cid] = clp
            _check_chosen(row, tid, lp, i)
            top.append(row)
        return cls(ids, lps, top)


def _entry(item: Any, where: str) -> tuple[float, int]:
    """(logprob, token id) of one [lp, id, text?] entry."""
    if not isinstance(item, (list, tuple)) or len(item) < 2:
        raise ValueError(f"meta_info {where}: expected [logprob, token id, ...], got {item!r}")
    lp, tid = item[0], item[1]
    if lp is None:
        lp = -math.inf
    if not isinstance(lp, (int, float)) or isinstance(tid, bool) or not isinstance(tid, int):
        raise ValueError(f"meta_info {where}: expected [logprob, token id, ...], got {item!r}")
    return float(lp), tid


def _check_chosen(row: dict[int, float], tid: int, lp: float, i: int) -> None:
    """A position's chosen token is in its own top-k row with the same logprob whenever it ranks
    there (a greedy reply's is its top-1); a row without it would hide how far it moved."""
    if tid in row:
        same = row[tid] == lp or abs(row[tid] - lp) <= 1e-4 or (math.isnan(row[tid])
                                                                and math.isnan(lp))
        if not same:
            raise ValueError(f"meta_info position {i}: token {tid} at {lp} but {row[tid]} in its "
                             "top-k")
    elif math.isnan(lp) or lp > min(row.values()):
        raise ValueError(f"meta_info position {i}: token {tid} (logprob {lp}) ranks in the top-k "
                         "but is not in its row")


STREAMED = ("output_token_logprobs", "output_top_logprobs")    # lists per generated position


class Streamed:
    """A streamed reply's token ids and per-position logprob lists. Each chunk's `output_ids`
    and per-position lists end at position `meta_info.completion_tokens` (all positions so far,
    or only the new ones), so they are put in place from that less their length."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.lists: dict[str, list[Any]] = {k: [] for k in STREAMED}
        self.expected = 0                    # the highest completion_tokens a chunk named

    def add(self, chunk: dict[str, Any]) -> None:
        """Put one chunk in place; ValueError where it cannot be placed exactly (no
        `completion_tokens`, or positions between those held and the chunk's missing)."""
        new = [int(t) for t in chunk.get("output_ids") or []]
        meta = chunk.get("meta_info") or {}
        done = meta.get("completion_tokens")
        if isinstance(done, bool) or not isinstance(done, int) or done < len(new):
            raise ValueError(f"a streamed chunk's meta_info.completion_tokens {done!r} does not "
                             f"cover its {len(new)} output_ids")
        self.expected = max(self.expected, done)
        start = done - len(new)
        if start > len(self.ids):
            raise ValueError(f"a streamed chunk starts at position {start} but only "
                             f"{len(self.ids)} are held: a chunk is missing")
        self.ids = self.ids[:start] + new
        for key, values in self.lists.items():
            got = meta.get(key)
            if isinstance(got, list):
                del values[start:]
                values += got[-len(new):] if new else []

    def answer(self) -> Answer:
        """The whole reply's Answer; ValueError where the logprobs do not cover exactly the
        tokens streamed (a server that ignored `REQUEST`, a malformed chunk)."""
        if not self.ids or len(self.ids) != self.expected:
            raise ValueError(f"the stream held {len(self.ids)} tokens of the "
                             f"{self.expected} its chunks named")
        got = Answer.from_meta(self.lists)
        if got.ids != self.ids:
            raise ValueError(f"the reply's logprobs name {len(got.ids)} tokens "
                             f"{got.ids[:8]}..., its output_ids {len(self.ids)} {self.ids[:8]}...")
        return got


@dataclass(frozen=True)
class Agreement:
    verdict: str              # "same" | "near-tie" | "different"
    max_delta: float          # largest |delta logprob| over compared positions (chosen + common top-k)
    topk_mismatches: int      # positions whose top-k id sets differ beyond ties at the cut
    first_diff: int | None    # first position whose generated token differs
    margin: float | None      # at first_diff: ref's logprob of its token minus of the other's
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.verdict != "different"

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 5) if isinstance(v, float) and math.isfinite(v) else v)
                for k, v in asdict(self).items()}

    def __str__(self) -> str:
        where = ("tokens all equal" if self.first_diff is None else
                 f"tokens part at {self.first_diff} (reference's margin "
                 + ("not in its top-k" if self.margin is None else f"{self.margin:.4f}") + ")")
        return (f"{self.verdict}: max |delta logprob| {self.max_delta:.4f} (tolerance "
                f"{self.tolerance:.4f}), {self.topk_mismatches} top-k mismatches, {where}")


def _topk_differs(a: dict[int, float], b: dict[int, float], tolerance: float) -> bool:
    """Whether the top-k id sets differ by more than ties at the cut: an id in one set only
    counts when its logprob there lies more than `tolerance` above that set's k-th."""
    if set(a) == set(b):
        return False
    for mine, theirs in ((a, b), (b, a)):
        if mine:
            kth = min(mine.values())
            if any(lp - kth > tolerance for t, lp in mine.items() if t not in theirs):
                return True
    return False


def compare(ref: Answer, other: Answer, tolerance: float = TOLERANCE) -> Agreement:
    """`other` against the reference `ref` (see the module's rules). ValueError on a tolerance
    that is not a number >= 0; an answer with no positions agrees with nothing."""
    if not isinstance(tolerance, (int, float)) or not tolerance >= 0:   # NaN fails too
        raise ValueError(f"tolerance {tolerance!r}: expected a number of nats >= 0")
    if not ref.ids or not other.ids:
        return Agreement("different", math.inf, 0, 0, None, tolerance)
    n = min(len(ref.ids), len(other.ids))
    first = next((i for i in range(n) if ref.ids[i] != other.ids[i]), None)
    if first is None and len(ref.ids) != len(other.ids):
        first = n                            # one stopped early: they part there
    upto = n if first is None else min(first + 1, n)
    deltas: list[float] = []
    mismatches = 0
    for i in range(upto):
        if ref.ids[i] == other.ids[i]:
            deltas.append(abs(_at(ref.logprobs, i) - _at(other.logprobs, i)))
        rt, ot = _at_top(ref.top, i), _at_top(other.top, i)
        deltas += [abs(rt[t] - ot[t]) for t in rt.keys() & ot.keys()]
        deltas += _one_sided(rt, ot) + _one_sided(ot, rt)
        if i != first and _topk_differs(rt, ot, tolerance):
            mismatches += 1
    finite = [d for d in deltas if math.isfinite(d)]
    worst = max(finite, default=0.0)
    if len(finite) != len(deltas):
        worst = math.inf                     # -inf on one side only: as far apart as can be
    margin: float | None = None
    if first is not None and first < n:
        rt = _at_top(ref.top, first)
        theirs = other.ids[first]
        if theirs in rt:
            margin = _at(ref.logprobs, first) - rt[theirs]
    if worst > tolerance:
        verdict = "different"
    elif first is None:
        verdict = "same"
    elif margin is not None and margin <= tolerance:
        verdict = "near-tie"
    else:
        verdict = "different"
    return Agreement(verdict, worst, mismatches, first, margin, tolerance)


def _one_sided(mine: dict[int, float], theirs: dict[int, float]) -> list[float]:
    """A lower bound of |delta| for each id in `mine`'s top-k only: in `theirs` it ranks below
    their k-th, so it moved by at least its logprob here less that k-th (0 for a tie at the
    cut)."""
    if not theirs:
        return [math.inf] if mine else []
    kth = min(theirs.values())
    return [max(0.0, lp - kth) for t, lp in mine.items() if t not in theirs]


def _at(values: list[float], i: int) -> float:
    return values[i] if i < len(values) else math.nan


def _at_top(tops: list[dict[int, float]], i: int) -> dict[int, float]:
    return tops[i] if i < len(tops) else {}
