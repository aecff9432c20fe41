"""offload.agree: each verdict's branch on hand-made answers, and SGLang's real meta_info read back.

`REAL_LAST` is the last streamed chunk of a real reply (SmolLM2-135M-Instruct, enable-fp32-lm-head,
a 256-token chat prompt, 4 greedy tokens "This document is about", offload.agree.REQUEST),
captured from SGLang 0.5.23's /generate with stream=true; logprobs rounded to 6 decimals, keys the
module does not read dropped. SGLang streams every position so far in each chunk (its default);
with --incremental-streaming-output each chunk holds only the new positions: both are rebuilt
from it by slicing, as the server slices (`_slice_streaming_output_meta_info`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from offload.agree import (
    RANDOM_TOLERANCE,
    REQUEST,
    TOLERANCE,
    TOP_K,
    Agreement,
    Answer,
    Streamed,
    compare,
    tolerance_for,
)

REAL_LAST: dict[str, Any] = {
    "output_ids": [1348, 3140, 314, 563],
    "meta_info": {
        "output_token_logprobs": [[-0.91622, 1348, None], [-1.520373, 3140, None],
                                  [-0.912473, 314, None], [-0.215657, 563, None]],
        "output_top_logprobs": [
            [[-0.91622, 1348, None], [-2.056349, 504, None], [-2.618281, 6340, None],
             [-3.364195, 49, None], [-3.503504, 44, None]],
            [[-1.520373, 3140, None], [-1.600873, 5075, None], [-1.867282, 314, None],
             [-2.523404, 2524, None], [-4.446074, 1694, None]],
            [[-0.912473, 314, None], [-2.781625, 3593, None], [-2.858766, 6601, None],
             [-3.128427, 14374, None], [-3.249561, 2433, None]],
            [[-0.215657, 563, None], [-2.502869, 253, None], [-4.211221, 354, None],
             [-4.747272, 599, None], [-4.946328, 2855, None]]],
        "completion_tokens": 4}}


def _chunks(incremental: bool) -> list[dict[str, Any]]:
    out = []
    meta = REAL_LAST["meta_info"]
    for n in range(1, 5):
        lo = n - 1 if incremental else 0
        out.append({"output_ids": REAL_LAST["output_ids"][lo:n],
                    "meta_info": {"completion_tokens": n,
                                  "output_token_logprobs": meta["output_token_logprobs"][lo:n],
                                  "output_top_logprobs": meta["output_top_logprobs"][lo:n]}})
    return out


def answer(ids: list[int], lps: list[float], tops: list[dict[int, float]] | None = None
           ) -> Answer:
    return Answer(ids, lps, tops if tops is not None else [{i: lp} for i, lp in zip(ids, lps)])


def test_request_asks_for_the_chosen_tokens_and_the_top_k() -> None:
    assert REQUEST["return_logprob"] is True and REQUEST["top_logprobs_num"] == TOP_K == 5
    assert REQUEST["logprob_start_len"] == -1        # no input logprobs: the prefix stays cached
    assert 0 < RANDOM_TOLERANCE < TOLERANCE <= 1.0


def test_the_random_demo_model_gets_its_own_tighter_tolerance(tmp_path: Path) -> None:
    from offload.demo import DemoSpec, write_demo

    write_demo(tmp_path / "demo", DemoSpec(layers=1, hidden=64, heads=1, kv_heads=1,
                                           intermediate=64, vocab=512, context=256))
    assert tolerance_for(tmp_path / "demo") == RANDOM_TOLERANCE < TOLERANCE
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "config.json").write_text('{"_name_or_path": "HuggingFaceTB/x"}')
    assert tolerance_for(tmp_path / "real") == TOLERANCE
    assert tolerance_for(tmp_path / "absent") == tolerance_for(None) == TOLERANCE
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("[not json")
    assert tolerance_for(str(tmp_path / "bad")) == TOLERANCE


def test_from_meta_reads_a_real_reply() -> None:
    a = Answer.from_meta(REAL_LAST["meta_info"])
    assert a.ids == [1348, 3140, 314, 563]
    assert a.logprobs == [-0.91622, -1.520373, -0.912473, -0.215657]
    assert len(a.top) == 4 and all(len(t) == TOP_K for t in a.top)
    assert a.top[1] == {3140: -1.520373, 5075: -1.600873, 314: -1.867282, 2524: -2.523404,
                        1694: -4.446074}
    assert compare(a, a).verdict == "same" and compare(a, a).max_delta == 0.0


@pytest.mark.parametrize("incremental", [False, True])
def test_a_stream_is_put_together_whichever_way_sglang_streams(incremental: bool) -> None:
    s = Streamed()
    for chunk in _chunks(incremental):
        s.add(chunk)
    assert s.ids == REAL_LAST["output_ids"]
    assert s.answer() == Answer.from_meta(REAL_LAST["meta_info"])


def test_a_stream_without_logprobs_is_an_error_not_an_empty_agreement() -> None:
    s = Streamed()
    s.add({"output_ids": [1, 2], "meta_info": {"completion_tokens": 2}})
    with pytest.raises(ValueError, match="logprobs"):
        s.answer()


@pytest.mark.parametrize("meta,match", [
    ({}, "REQUEST"),
    ({"output_token_logprobs": [[-1.0, 5]], "output_top_logprobs": []}, "1 output_token"),
    ({"output_token_logprobs": [["x", 5]], "output_top_logprobs": [[]]}, r"\[0\]"),
    ({"output_token_logprobs": [[-1.0, 5]], "output_top_logprobs": [[[-1.0]]]}, r"\[0\]\[0\]"),
])
def test_malformed_meta_is_a_value_error_naming_the_entry(meta: dict[str, Any], match: str
                                                          ) -> None:
    with pytest.raises(ValueError, match=match):
        Answer.from_meta(meta)


def test_same_within_the_tolerance() -> None:
    ref = answer([1, 2, 3], [-0.5, -1.0, -0.2], [{1: -0.5, 9: -2.0}, {2: -1.0, 8: -1.5},
                                                  {3: -0.2, 7: -3.0}])
    hit = answer([1, 2, 3], [-0.52, -0.97, -0.2], [{1: -0.52, 9: -2.03}, {2: -0.97, 8: -1.5},
                                                    {3: -0.2, 7: -3.0}])
    ag = compare(ref, hit, tolerance=0.05)
    assert (ag.verdict, ag.first_diff, ag.margin, ag.topk_mismatches) == ("same", None, None, 0)
    assert ag.max_delta == pytest.approx(0.03) and ag.ok


def test_a_chosen_logprob_beyond_the_tolerance_is_different_even_with_equal_tokens() -> None:
    ag = compare(answer([1, 2], [-0.5, -1.0]), answer([1, 2], [-0.5, -1.3]), tolerance=0.1)
    assert ag.verdict == "different" and not ag.ok
    assert ag.max_delta == pytest.approx(0.3) and ag.first_diff is None


def test_a_top_k_candidate_beyond_the_tolerance_is_different() -> None:
    ref = answer([1], [-0.5], [{1: -0.5, 4: -1.0}])
    hit = answer([1], [-0.5], [{1: -0.5, 4: -1.4}])
    ag = compare(ref, hit, tolerance=0.1)
    assert ag.verdict == "different" and ag.max_delta == pytest.approx(0.4)


def test_tokens_parting_at_a_near_tie_are_a_near_tie() -> None:
    ref = answer([1, 2, 3], [-0.5, -0.70, -0.1], [{1: -0.5}, {2: -0.70, 5: -0.72}, {3: -0.1}])
    hit = answer([1, 5, 6], [-0.5, -0.69, -0.1], [{1: -0.5}, {5: -0.69, 2: -0.705}, {6: -0.1}])
    ag = compare(ref, hit, tolerance=0.05)
    assert ag.verdict == "near-tie" and ag.ok
    assert ag.first_diff == 1 and ag.margin == pytest.approx(0.02)
    assert ag.max_delta == pytest.approx(0.03)      # position 1's common candidates; 2 not compared
    assert "near-tie" in str(ag) and "part at 1" in str(ag)


def test_tokens_parting_with_a_wide_margin_are_different() -> None:
    ref = answer([1, 2], [-0.5, -0.2], [{1: -0.5}, {2: -0.2, 5: -1.9}])
    hit = answer([1, 5], [-0.5, -0.21], [{1: -0.5}, {5: -0.21, 2: -0.22}])
    ag = compare(ref, hit, tolerance=0.1)
    assert ag.verdict == "different" and ag.margin == pytest.approx(1.7) and ag.first_diff == 1


def test_tokens_parting_on_a_token_outside_the_reference_top_k_are_different() -> None:
    ag = compare(answer([1, 2], [-0.5, -0.2]), answer([1, 7], [-0.5, -0.2]), tolerance=0.1)
    assert ag.verdict == "different" and ag.margin is None and "not in its top-k" in str(ag)


def test_a_near_tie_after_a_drift_beyond_the_tolerance_is_different() -> None:
    ref = answer([1, 2], [-0.5, -0.7], [{1: -0.5}, {2: -0.7, 5: -0.71}])
    hit = answer([1, 5], [-0.9, -0.7], [{1: -0.9}, {5: -0.7, 2: -0.71}])
    assert compare(ref, hit, tolerance=0.1).verdict == "different"


def test_one_reply_stopping_early_is_different() -> None:
    ag = compare(answer([1, 2, 3], [-0.1] * 3), answer([1, 2], [-0.1] * 2))
    assert ag.verdict == "different" and ag.first_diff == 2


def test_top_k_mismatches_count_only_beyond_a_tie_at_the_cut() -> None:
    base = {1: -0.1, 2: -1.0, 3: -2.0}
    tie = {1: -0.1, 2: -1.0, 4: -2.0}           # 3 and 4 swap at the cut: a tie
    real = {1: -0.1, 4: -1.0, 3: -2.0}          # 2 gone from a rank well above the cut
    ref = answer([1, 1], [-0.1, -0.1], [base, base])
    assert compare(ref, answer([1, 1], [-0.1, -0.1], [base, tie]), 0.05).topk_mismatches == 0
    ag = compare(ref, answer([1, 1], [-0.1, -0.1], [real, base]), 0.05)
    # 2 left the top-3 from -1.0: below the other's 3rd (-2.0), so it moved >= 1.0 nats
    assert ag.topk_mismatches == 1 and ag.verdict == "different" and ag.max_delta >= 1.0


def test_minus_infinity_on_one_side_only_is_as_far_as_can_be() -> None:
    ag = compare(answer([1], [-0.1], [{1: -0.1, 2: -3.0}]),
                 answer([1], [-0.1], [{1: -0.1, 2: -math.inf}]))
    assert ag.verdict == "different" and ag.max_delta == math.inf
    assert ag.as_dict()["max_delta"] == math.inf


def test_as_dict_and_str_carry_every_field() -> None:
    ag = compare(answer([1], [-0.5]), answer([1], [-0.5123456]), tolerance=0.1)
    d = ag.as_dict()
    assert set(d) == {"verdict", "max_delta", "topk_mismatches", "first_diff", "margin",
                      "tolerance"}
    assert d["max_delta"] == 0.01235 and d["tolerance"] == 0.1
    assert str(ag).startswith("same: max |delta logprob| 0.0123 (tolerance 0.1000)")
    assert isinstance(ag, Agreement)
