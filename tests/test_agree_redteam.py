"""Red team of offload.agree: attacks on `compare`, `Answer.from_meta`, `Streamed` and
`tolerance_for`. An attack that held is a plain test; a hole is a strict xfail naming the fix."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
from pathlib import Path
from typing import Any

import pytest

from offload.agree import (
    RANDOM_TOLERANCE,
    TOLERANCE,
    TOP_K,
    Answer,
    Streamed,
    compare,
    tolerance_for,
)


def meta(rows: list[tuple[float, int, list[tuple[float, int]]]]) -> dict[str, Any]:
    """SGLang meta_info from (chosen lp, chosen id, [(cand lp, cand id), ...]) per position."""
    return {"output_token_logprobs": [[lp, tid, None] for lp, tid, _ in rows],
            "output_top_logprobs": [[[c, i, None] for c, i in cands] for _, _, cands in rows]}


def full_top(chosen: int, lp: float, rest: list[tuple[int, float]]) -> dict[int, float]:
    return {chosen: lp, **dict(rest)}


def answer(ids: list[int], lps: list[float], tops: list[dict[int, float]]) -> Answer:
    return Answer(ids, lps, tops)


REF = answer([7, 8], [-0.1, -0.2],
             [full_top(7, -0.1, [(1, -3.0), (2, -4.0), (3, -5.0), (4, -6.0)]),
              full_top(8, -0.2, [(1, -3.0), (2, -4.0), (3, -5.0), (4, -6.0)])])


# --- 1. no vacuous agreement -----------------------------------------------------------------------
def test_two_empty_answers_do_not_agree() -> None:
    empty = Answer([], [], [])
    assert compare(empty, empty).verdict == "different"


def test_a_stream_with_no_chunks_is_an_error() -> None:
    with pytest.raises(ValueError):
        Streamed().answer()


@pytest.mark.parametrize("a_len,b_len", [(0, 2), (2, 0), (1, 2), (2, 1)])
def test_answers_of_different_lengths_never_agree(a_len: int, b_len: int) -> None:
    a = Answer(REF.ids[:a_len], REF.logprobs[:a_len], REF.top[:a_len])
    b = Answer(REF.ids[:b_len], REF.logprobs[:b_len], REF.top[:b_len])
    for tol in (0.0, TOLERANCE, 1e9, math.inf):
        assert compare(a, b, tol).verdict == "different", (a_len, b_len, tol)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("side", ["ref", "other", "both"])
def test_non_finite_logprobs_never_agree(bad: float, side: str) -> None:
    rows = [(-0.1, 7, [(-0.1, 7), (-3.0, 1)]), (-0.2, 8, [(-0.2, 8), (-3.0, 1)])]
    broken = [(bad, 7, [(bad, 7), (-3.0, 1)]), rows[1]]
    a = Answer.from_meta(meta(broken if side in ("ref", "both") else rows))
    b = Answer.from_meta(meta(broken if side in ("other", "both") else rows))
    for tol in (TOLERANCE, 1e9):
        # conservative: even -inf on both sides (nan delta) is "different", never "same"
        assert compare(a, b, tol).verdict == "different", (bad, side, tol)


def test_none_logprob_reads_as_minus_infinity_and_does_not_agree_with_a_finite_one() -> None:
    a = Answer.from_meta(meta([(None, 7, [(None, 7)])]))            # type: ignore[list-item]
    b = Answer.from_meta(meta([(-0.1, 7, [(-0.1, 7)])]))
    assert a.logprobs == [-math.inf] and compare(a, b, 1e9).verdict == "different"


@pytest.mark.parametrize("tokens,tops", [(2, 1), (1, 2), (0, 1), (1, 0)])
def test_logprobs_that_do_not_cover_the_tokens_raise(tokens: int, tops: int) -> None:
    m = meta([(-0.1, 7, [(-0.1, 7)]), (-0.2, 8, [(-0.2, 8)])])
    m["output_token_logprobs"] = m["output_token_logprobs"][:tokens]
    m["output_top_logprobs"] = m["output_top_logprobs"][:tops]
    with pytest.raises(ValueError):
        Answer.from_meta(m)


@pytest.mark.parametrize("row", [None, []])
def test_missing_top_k_is_an_error(row: Any) -> None:
    m = meta([(-0.1, 7, [(-0.1, 7), (-3.0, 1)])])
    m["output_top_logprobs"][0] = row
    with pytest.raises(ValueError):
        Answer.from_meta(m)


def test_duplicated_ids_in_top_k_are_an_error() -> None:
    ref = Answer.from_meta(meta([(-0.1, 7, [(-0.1, 7), (-3.0, 1), (-4.0, 2)])]))
    other_m = meta([(-0.1, 7, [(-0.1, 7), (-12.0, 1), (-3.0, 1), (-4.0, 2)])])
    try:
        other = Answer.from_meta(other_m)
    except ValueError:
        return
    assert compare(ref, other).verdict == "different"


# --- 2. differing beyond the tolerance is never "same" / "near-tie" ---------------------------------
def test_a_token_in_one_top_k_only_far_above_the_cut_is_different() -> None:
    ref = answer([7], [-0.1], [{7: -0.1, 2: -1.0, 3: -5.0, 4: -6.0, 5: -7.0}])
    other = answer([7], [-0.1], [{7: -0.1, 3: -5.0, 4: -6.0, 5: -7.0, 6: -7.5}])
    got = compare(ref, other)
    assert got.topk_mismatches == 1                  # seen ...
    assert got.verdict == "different", got           # ... but not acted on


def test_a_token_in_one_top_k_only_at_a_tie_at_the_cut_is_not_a_mismatch() -> None:
    ref = answer([7], [-0.1], [{7: -0.1, 2: -3.0, 3: -5.0, 4: -6.0, 5: -7.0}])
    other = answer([7], [-0.1], [{7: -0.1, 2: -3.0, 3: -5.0, 4: -6.0, 6: -7.0}])
    got = compare(ref, other)
    assert (got.verdict, got.topk_mismatches) == ("same", 0)


def test_a_parting_where_the_other_drops_the_reference_s_token_far_is_different() -> None:
    ref = answer([7], [-0.50], [{7: -0.50, 8: -0.51, 3: -5.0, 4: -6.0, 5: -7.0}])
    other = answer([8], [-0.01], [{8: -0.01, 3: -5.0, 4: -6.0, 5: -7.0, 6: -8.0}])
    assert compare(ref, other).verdict == "different"


def test_a_parting_whose_other_row_omits_its_own_chosen_token_is_an_error() -> None:
    ref_m = meta([(-0.5, 7, [(-0.5, 7), (-0.52, 9), (-5.0, 3), (-6.0, 4), (-7.0, 5)])])
    other_m = meta([(-3.0, 9, [(-0.5, 7), (-0.6, 8), (-5.0, 3), (-6.0, 4), (-7.0, 5)])])
    try:
        other = Answer.from_meta(other_m)
    except ValueError:
        return
    got = compare(Answer.from_meta(ref_m), other)
    assert got.verdict == "different", got          # 9: ref -0.52, other -3.0, never compared


def test_the_margin_is_the_reference_s() -> None:
    """The ref's logprob of its own token minus its logprob of the other's; swapping the
    arguments reads the other side."""
    close = answer([7], [-0.50], [{7: -0.50, 8: -0.60, 3: -5.0, 4: -6.0, 5: -7.0}])
    wide = answer([8], [-0.55], [{8: -0.55, 7: -0.52, 3: -5.0, 4: -6.0, 5: -7.0}])
    # hand-checked: close's margin 0.10; wide's (its 8 minus its 7) -0.03; deltas 0.05, 0.02
    a = compare(close, wide)
    assert (a.verdict, a.first_diff) == ("near-tie", 0) and a.margin == pytest.approx(0.10)
    b = compare(wide, close)
    assert b.margin == pytest.approx(-0.03)
    far = answer([7], [-0.1], [{7: -0.1, 8: -2.0, 3: -5.0, 4: -6.0, 5: -7.0}])
    flip = answer([8], [-0.1], [{8: -0.1, 7: -2.0, 3: -5.0, 4: -6.0, 5: -7.0}])
    assert compare(far, flip, 100.0).max_delta == pytest.approx(1.9)
    assert compare(far, flip).verdict == "different"            # delta 1.9 > 0.7
    assert compare(far, flip, 1.95).margin == pytest.approx(1.9)
    assert compare(far, flip, 1.95).verdict == "near-tie"


def test_positions_after_the_parting_are_not_compared_but_all_before_it_are() -> None:
    ref = answer([1, 2, 3], [-0.1, -0.1, -0.1],
                 [{1: -0.1, 9: -0.15}, {2: -0.1, 5: -0.15}, {3: -0.1}])
    drift_before = answer([1, 5, 3], [-0.9, -0.15, -50.0],
                          [{1: -0.9, 9: -0.15}, {5: -0.15, 2: -0.1}, {3: -50.0}])
    assert compare(ref, drift_before).verdict == "different"     # 0.8 at position 0
    ok = answer([1, 5, 3], [-0.1, -0.15, -50.0],
                [{1: -0.1, 9: -0.15}, {5: -0.15, 2: -0.1}, {3: -50.0}])
    assert compare(ref, ok).verdict == "near-tie"                # after the parting: free


def _random_answer(rng: random.Random, n: int, base: Answer | None) -> Answer:
    ids, lps, tops = [], [], []
    for i in range(n):
        if base is not None and i < len(base.ids) and rng.random() < 0.8:
            tid = base.ids[i]
            row = {k: v + rng.uniform(-1.0, 1.0) * rng.choice([0.001, 0.3, 2.0])
                   for k, v in base.top[i].items()}
        else:
            tid = rng.randrange(6)
            row = {k: -rng.uniform(0, 6) for k in rng.sample(range(6), 4)}
        row.setdefault(tid, -rng.uniform(0, 1))
        ids.append(tid)
        lps.append(row[tid])
        tops.append(row)
    return Answer(ids, lps, tops)


def test_the_verdict_is_monotone_in_the_tolerance_and_never_hides_a_compared_delta() -> None:
    rng = random.Random(47)
    rank = {"same": 0, "near-tie": 1, "different": 2}
    tols = [0.0, 0.001, 0.01, 0.1, 0.3, 0.7, 1.0, 2.0, 5.0, 1e9, math.inf]
    for _ in range(3000):
        ref = _random_answer(rng, rng.randrange(1, 5), None)
        other = _random_answer(rng, rng.randrange(1, 5), ref)
        got = [compare(ref, other, t) for t in tols]
        ranks = [rank[g.verdict] for g in got]
        assert ranks == sorted(ranks, reverse=True), (ref, other, [g.verdict for g in got])
        for t, g in zip(tols, got):
            if g.ok:                  # recompute the documented rule by hand
                first = g.first_diff
                upto = len(ref.ids) if first is None else first + 1
                if first is None:               # no parting: the same length
                    assert len(ref.ids) == len(other.ids)
                for i in range(upto):
                    if ref.ids[i] == other.ids[i]:
                        assert abs(ref.logprobs[i] - other.logprobs[i]) <= t
                    for k in ref.top[i].keys() & other.top[i].keys():
                        assert abs(ref.top[i][k] - other.top[i][k]) <= t
                if first is not None:
                    assert g.margin is not None and g.margin <= t


def test_a_nan_tolerance_is_refused() -> None:
    far = answer([7, 8], [-0.1, -9.0], [{7: -0.1}, {8: -9.0}])
    try:
        got = compare(REF, far, math.nan)
    except ValueError:
        return
    assert got.verdict == "different"


def test_a_negative_tolerance_is_refused() -> None:
    with pytest.raises(ValueError):
        compare(REF, REF, -1.0)


# --- 3. Streamed: every position in place exactly once --------------------------------------------
ROWS = [(-0.1 * (i + 1), 100 + i, [(-0.1 * (i + 1), 100 + i), (-5.0, 1)]) for i in range(4)]
FULL = meta(ROWS)
IDS = [r[1] for r in ROWS]


def chunk(lo: int, hi: int, completion: int | None = None, drop: tuple[str, ...] = ()
          ) -> dict[str, Any]:
    m: dict[str, Any] = {k: v[lo:hi] for k, v in FULL.items() if k not in drop}
    if completion is not None:
        m["completion_tokens"] = completion
    return {"output_ids": IDS[lo:hi], "meta_info": m}


def assemble(chunks: list[dict[str, Any]]) -> Answer:
    s = Streamed()
    for c in chunks:
        s.add(c)
    return s.answer()


def whole_or_error(chunks: list[dict[str, Any]], upto: int = 4) -> None:
    """The stream is either the reply's first `upto` positions, each once, or a ValueError."""
    try:
        got = assemble(chunks)
    except ValueError:
        return
    assert got == Answer.from_meta({k: v[:upto] for k, v in FULL.items()}), got.ids


@pytest.mark.parametrize("incremental", [False, True])
def test_a_repeated_chunk_is_put_in_place_once(incremental: bool) -> None:
    seq = [chunk(n - 1 if incremental else 0, n, n) for n in range(1, 5)]
    for i in range(4):
        whole_or_error(seq[: i + 1] + seq[i:])


def test_cumulative_chunks_out_of_order_but_ending_with_the_last_are_whole() -> None:
    seq = [chunk(0, n, n) for n in range(1, 5)]
    whole_or_error([seq[1], seq[0], seq[2], seq[3]])
    whole_or_error([seq[2], seq[0], seq[3]])


def test_an_incremental_gap_is_an_error() -> None:
    whole_or_error([chunk(0, 1, 1), chunk(2, 4, 4)])


@pytest.mark.parametrize("order", ["incremental swapped", "cumulative stale last",
                                   "stale empty chunk"])
def test_chunks_out_of_order_never_drop_positions(order: str) -> None:
    if order == "incremental swapped":
        whole_or_error([chunk(0, 1, 1), chunk(2, 3, 3), chunk(1, 2, 2)], upto=3)
    elif order == "cumulative stale last":
        whole_or_error([chunk(0, 4, 4), chunk(0, 2, 2)])
    else:
        whole_or_error([chunk(0, 4, 4), {"output_ids": [], "meta_info": {
            "completion_tokens": 1, "output_token_logprobs": [], "output_top_logprobs": []}}])


def test_a_stale_empty_chunk_without_lists_is_an_error_not_a_shorter_answer() -> None:
    whole_or_error([chunk(0, 4, 4), {"output_ids": [], "meta_info": {"completion_tokens": 1}}])


def test_cumulative_chunks_without_completion_tokens_never_duplicate() -> None:
    whole_or_error([chunk(0, n) for n in range(1, 5)])


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("key", ["output_token_logprobs", "output_top_logprobs"])
def test_lists_shorter_than_the_ids_are_an_error(incremental: bool, key: str) -> None:
    seq = [chunk(n - 1 if incremental else 0, n, n) for n in range(1, 5)]
    short = [dict(c, meta_info={**c["meta_info"], key: c["meta_info"][key][-1:][:0]})
             if i == 2 else c for i, c in enumerate(seq)]
    if incremental:
        with pytest.raises(ValueError):
            assemble(short)
    else:
        whole_or_error(short)               # the next cumulative chunk brings them all again
    dropped = [chunk(c["meta_info"]["completion_tokens"] - len(c["output_ids"]),
                     c["meta_info"]["completion_tokens"], c["meta_info"]["completion_tokens"],
                     drop=(key,)) if i == 3 else c for i, c in enumerate(seq)]
    with pytest.raises(ValueError):
        assemble(dropped)


def test_lists_shorter_than_completion_tokens_in_a_cumulative_chunk_are_an_error() -> None:
    c = chunk(0, 4, 4)
    for key in FULL:
        c["meta_info"][key] = FULL[key][2:]         # the last two positions' lists only
    with pytest.raises(ValueError):
        assemble([c])


def test_every_prefix_split_of_both_modes_is_whole() -> None:
    for cuts in itertools.combinations(range(1, 4), 2):
        bounds = [0, *cuts, 4]
        inc = [chunk(lo, hi, hi) for lo, hi in zip(bounds, bounds[1:])]
        cum = [chunk(0, hi, hi) for hi in bounds[1:]]
        assert assemble(inc) == assemble(cum) == Answer.from_meta(FULL)


# --- 4. tolerance_for -----------------------------------------------------------------------------
def _demo(family: str, out: Path) -> Path:
    from offload.demo import FAMILIES, DemoSpec

    spec = DemoSpec(layers=1, hidden=64, heads=2, kv_heads=1, intermediate=64, vocab=512,
                    context=256)
    FAMILIES[family].write(out, spec)
    return out


@pytest.mark.parametrize("family", ["llama", "mla", "swa"])
def test_every_random_family_gets_the_tight_tolerance(family: str, tmp_path: Path) -> None:
    d = _demo(family, tmp_path / family)
    assert json.loads((d / "config.json").read_text())["_name_or_path"] == "sglang-offload-demo"
    assert tolerance_for(d) == tolerance_for(str(d)) == RANDOM_TOLERANCE


def test_a_symlink_to_the_demo_reads_the_demo_s_config(tmp_path: Path) -> None:
    d = _demo("llama", tmp_path / "demo")
    os.symlink(d, tmp_path / "link")
    assert tolerance_for(tmp_path / "link") == RANDOM_TOLERANCE
    (tmp_path / "cfg").mkdir()
    os.symlink(d / "config.json", tmp_path / "cfg" / "config.json")
    assert tolerance_for(tmp_path / "cfg") == RANDOM_TOLERANCE     # only config.json is read


def test_a_user_model_copying_the_demo_s_name_gets_the_tighter_tolerance_only(tmp_path: Path
                                                                               ) -> None:
    """Only config.json's _name_or_path is read: a real model that copies the name is checked
    at 0.01 (stricter: false 'different', never a weaker check); nothing can pick a tolerance
    above TOLERANCE."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {"_name_or_path": "sglang-offload-demo", "model_type": "llama", "num_hidden_layers": 30}))
    assert tolerance_for(tmp_path / "m") == RANDOM_TOLERANCE
    for doc in ('["sglang-offload-demo"]', '{"_name_or_path": ["sglang-offload-demo"]}',
                '"sglang-offload-demo"', '{"_name_or_path": null}'):
        (tmp_path / "m" / "config.json").write_text(doc)
        assert tolerance_for(tmp_path / "m") == TOLERANCE
    (tmp_path / "m" / "config.json").write_bytes(b"\xff\xfe{}")         # not UTF-8
    assert tolerance_for(tmp_path / "m") == TOLERANCE
    assert max(tolerance_for(p) for p in (None, "", tmp_path, tmp_path / "m",
                                          "HuggingFaceTB/SmolLM2-135M-Instruct")) == TOLERANCE


def test_a_directory_without_config_json_or_a_file_gets_the_wide_tolerance(tmp_path: Path
                                                                            ) -> None:
    """Weaker than documented only for a random demo whose config.json cannot be read (then it
    cannot be served either): a demo's config.json that lost its _name_or_path, or a path read
    on another machine than the server's (`tolerance_for` reads the local file system with the
    server's reported model_path: `bench` against a remote server)."""
    d = _demo("llama", tmp_path / "demo")
    assert tolerance_for(d / "model.safetensors") == TOLERANCE
    cfg = json.loads((d / "config.json").read_text())
    del cfg["_name_or_path"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert tolerance_for(d) == TOLERANCE
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    assert tolerance_for(d) == TOLERANCE
    assert TOP_K == 5


# --- 5. LaunchedServer.generate: a streamed error is not an (empty, agreeing) answer ---------------
def _serve(chunks: list[str]) -> tuple[str, Any]:
    """A loopback HTTP server answering /generate with these SSE data lines, then [DONE]."""
    import http.server
    import threading

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for c in [*chunks, "[DONE]"]:
                self.wfile.write(f"data: {c}\n\n".encode())

        def log_message(self, *a: Any) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{srv.server_address[1]}", srv


def test_generate_reads_a_streamed_reply_whole() -> None:
    from offload.launch.server import LaunchedServer

    url, srv = _serve([json.dumps(chunk(0, n, n)) for n in range(1, 5)])
    try:
        got = LaunchedServer.at(url).generate([1, 2, 3], 4)
    finally:
        srv.shutdown()
    assert got.output_ids == IDS and got.answer == Answer.from_meta(FULL)


ERROR = {"error": {"message": "The input (9000 tokens) is longer than the model's context "
                              "length (8192 tokens).", "type": "invalid_request_error",
                   "code": 400, "retryable": False}}
ABORT = dict(chunk(0, 1, 1), meta_info={**chunk(0, 1, 1)["meta_info"],
                                        "finish_reason": {"type": "abort", "message": "aborted"}})


@pytest.mark.parametrize("chunks", [[json.dumps(ERROR)], [json.dumps(ABORT)]],
                         ids=["error", "abort"])
def test_generate_raises_on_a_streamed_error(chunks: list[str]) -> None:
    from offload.errors import RunError
    from offload.launch.server import LaunchedServer

    url, srv = _serve(chunks)
    try:
        with pytest.raises(RunError):
            reply = LaunchedServer.at(url).generate([1, 2, 3], 4)
            assert compare(reply.answer, reply.answer).verdict == "same"    # what it leads to
    finally:
        srv.shutdown()
