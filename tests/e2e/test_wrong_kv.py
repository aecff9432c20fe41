"""The answer checks have power: wrong KV with valid checksums fails them (issue 47 item 4).

Every L3 block is checksum-verified on read, so the tier never serves corrupt bytes; a bug that
lands the RIGHT bytes in the WRONG place passes every checksum. A test-only plant
(tests/fixtures/wrong_kv/sitecustomize.py, on the servers' PYTHONPATH; nothing under offload/
changes) wraps the L3 read path so that a read that succeeded then lands wrong KV in SGLang's host
pages, in a mode the test switches at run time (one server covers every mode):

- `other-prompt`: pages of another prompt under the right keys;
- `shift`: page i gets page i+1's bytes;
- `layers`: layers 0 and 1 swapped within each page;
- `heads`: KV heads 0 and 1 swapped within each page: on the demo model (2 KV heads) exactly TP
  rank 0's heads given to rank 1 and back at TP 2; the real model (3 KV heads, 9 query heads)
  cannot run at TP 2 at all, so there it is heads 0 <-> 1 of 3;
- `fp8-scale` (an fp8_e4m3 KV server): pages decoded, doubled, re-encoded: as if written with
  the wrong scale;
- `none`: the control, the plant on and nothing changed (first and last: the faults did not
  poison the L3).

Per server: prompt A cold (greedy, `NEW` tokens, logprobs); its write-back; A again at once (an
L1 hit); then per mode: `flush_l1_l2` (L1/L2 empty, L3 kept), the mode set, A again -> an L3 hit
(storage covers its full pages, the plant's log shows the pages it changed) ->
`offload.agree.compare(reference, hit, tolerance_for(model))` (each model's measured tolerance)
must be "different" under a fault and ok under `none`.
The reference is the cold reply, except with fp8 KV (the L1 hit: see that test). Each mode's
verdict, max |delta logprob|, first differing token and margin are printed (`pytest -s`): the
size of a real error, which the docs cite, with the cold-vs-L1 spread and the "same ids" column
of the old check (equal greedy token ids).

Three server starts: the demo model, the real model, the real model with an fp8 KV cache (it
starts as fast as the bf16 one; the demo model's random weights barely react to KV: doubled fp8
pages moved its logprobs by 0.12 nats, where the real model's first token left the top 5).
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest

from offload.agree import Agreement, compare, tolerance_for
from offload.launch.server import LaunchedServer, Reply, wait_store
from tests.e2e.conftest import PAGE, flush_l1_l2, full_pages, needs_serving, prompt

PLANT_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "wrong_kv"
DIR_ENV = "OFFLOAD_TEST_WRONG_KV_DIR"          # the plant's one variable (its module declares it)
NEW = 16                                        # generated tokens per request
DEMO_TOKENS = 1500                              # ~23 pages of made-up words
REAL_TOKENS = 2000                              # README text in a chat question
FAULTS = ("other-prompt", "shift", "layers", "heads")
# the tier's worth-it rule never declines a load here (a demo prefill is cheap): every hit is L3
NO_DECLINE = {"worth_it": {"enabled": False, "max_prefetch_wait_s": 120}}


def _plant_module() -> ModuleType:
    """The plant imported by path (no variable set: it installs nothing), for its transforms."""
    spec = importlib.util.spec_from_file_location("wrong_kv_plant", PLANT_DIR / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class PlantControl:
    """The test's side of the plant: its directory, the mode file, the log."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.set("none")

    def env(self) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(PLANT_DIR), os.environ.get("PYTHONPATH")) if p)
        return {"PYTHONPATH": path, DIR_ENV: str(self.root)}

    def set(self, mode: str) -> None:
        tmp = self.root / "mode.tmp"
        tmp.write_text(mode)
        tmp.replace(self.root / "mode")

    def records(self) -> list[dict[str, Any]]:
        log = self.root / "log.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@dataclass
class Outcome:
    mode: str
    agreement: Agreement
    same_ids: bool                 # the old check: equal greedy token ids
    hit: Reply
    storage: int                   # tokens SGLang loaded from L3
    changed: int                   # pages the plant changed in the hit's reads
    notes: list[str]

    def row(self, ref: Reply) -> str:
        a = self.agreement
        margin = "-" if a.margin is None else f"{a.margin:.4f}"
        parting = ""
        i = a.first_diff
        if i is not None and i < min(len(ref.answer.ids), len(self.hit.answer.ids)):
            r, h = ref.answer, self.hit.answer     # margin "-": the hit's pick is not in ref's top-k
            parting = (f"  at {i}: reference picks {r.ids[i]} ({r.logprobs[i]:.4f}), the hit "
                       f"{h.ids[i]} ({h.logprobs[i]:.4f})")
        return (f"{self.mode:13s} {a.verdict:9s} max_delta {a.max_delta:8.4f}  first_diff "
                f"{str(a.first_diff):4s} margin {margin:>8s}  topk_mismatches "
                f"{a.topk_mismatches:2d}  same ids {'yes' if self.same_ids else 'no ':3s}  "
                f"storage {self.storage}  pages changed {self.changed}{parting}")


def _stored(r: Reply) -> int:
    """Blocks a finished request leaves in the L3 (its prompt and output less the last token)."""
    return (r.prompt_tokens + len(r.output_ids) - 1) // PAGE


def _miss(r: Reply) -> None:
    assert r.cached_tokens == 0, (r.cached_tokens, r.details)


@dataclass
class Run:
    cold: Reply
    l1: Reply                      # A again at once: served from L1 (the device)
    reference: str                 # "cold" or "l1": what each hit is compared with
    tolerance: float               # the model's measured tolerance (offload.agree.tolerance_for)
    outcomes: list[Outcome]

    @property
    def ref(self) -> Reply:
        return self.cold if self.reference == "cold" else self.l1


def run_modes(s: LaunchedServer, store: Path, plant: PlantControl, a: str | list[int],
              donor: str | list[int] | None, modes: tuple[str, ...], model: Path,
              reference: str = "cold") -> Run:
    """The procedure of the module docstring; every mode's outcome, nothing asserted on them."""
    blocks = 0
    if donor is not None:                  # `other-prompt` serves these pages
        plant.set("donor")
        d = s.generate(donor, NEW)
        _miss(d)
        blocks += _stored(d)
        assert wait_store(store, blocks) >= blocks, s.tail()
        plant.set("none")
    cold = s.generate(a, NEW)
    _miss(cold)
    blocks += _stored(cold)
    assert wait_store(store, blocks) >= blocks, s.tail()
    l1 = s.generate(a, NEW)
    assert l1.details.get("device", 0) == full_pages(cold.prompt_tokens), l1.details
    run = Run(cold, l1, reference, tolerance_for(model), [])
    for mode in modes:
        flush_l1_l2(s)
        plant.set(mode)
        seen = len(plant.records())
        hit = s.generate(a, NEW)
        plant.set("none")
        reads = [r for r in plant.records()[seen:] if r["op"] == "read"]
        run.outcomes.append(Outcome(
            mode, compare(run.ref.answer, hit.answer, run.tolerance),
            hit.output_ids == run.ref.output_ids, hit,
            int(hit.details.get("storage", 0) or 0), sum(r["changed"] for r in reads),
            sorted({r["note"] for r in reads if r["note"]})))
    return run


def check(label: str, run: Run) -> None:
    """Print every mode's figures, then assert: each hit was an L3 hit of the whole prefix; the
    control agrees with nothing changed; every fault changed pages and is caught ("different")."""
    cold, outcomes = run.cold, run.outcomes
    print(f"\n{label}: {cold.prompt_tokens} prompt tokens, {len(cold.output_ids)} generated, "
          f"cold text {cold.text!r}\n  tolerance {run.tolerance} nats; cold vs L1 hit: "
          f"{compare(cold.answer, run.l1.answer, run.tolerance)}\n"
          f"  each L3 hit against the {run.reference} reply:")
    for o in outcomes:
        print("  " + o.row(run.ref) + (f"  notes {o.notes}" if o.notes else ""))
    controls = [o for o in outcomes if o.mode == "none"]
    print("  the controls' L3 hits against the L1 hit: "
          + "; ".join(str(compare(run.l1.answer, o.hit.answer, run.tolerance)) for o in controls))
    spread = max(o.agreement.max_delta for o in controls)
    print(f"  (for scale, at twice this run's own control spread, {2 * spread:.4f} nats: "
          + ", ".join(f"{o.mode} {compare(run.ref.answer, o.hit.answer, 2 * spread).verdict}"
                      for o in outcomes if o.mode != "none") + ")")
    want = full_pages(cold.prompt_tokens)
    problems = []
    for o in outcomes:
        if o.storage != want:
            problems.append(f"{o.mode}: the hit loaded {o.storage} tokens from L3, not the "
                            f"{want} of its full pages: the fault was not (all) on the path")
        elif o.mode == "none":
            if o.changed or not o.agreement.ok:
                problems.append(f"control (none): {o.changed} pages changed, {o.agreement}")
        elif o.changed == 0:
            problems.append(f"{o.mode}: the plant changed no page ({o.notes})")
        elif o.agreement.verdict != "different":
            problems.append(f"{o.mode}: WRONG KV NOT CAUGHT ({o.changed} pages changed): "
                            f"{o.agreement}")
    assert not problems, f"{label}:\n" + "\n".join(problems)


def test_the_plant_lands_each_fault_where_it_says() -> None:
    """The plant's transforms on a stand-in MHA host pool with SGLang's page_first layout
    ([2, tokens, layers, heads, head_dim]; `get_data_page(i, flat=False)` a view of one page)."""
    import torch

    plant_mod = _plant_module()

    class MHAStandIn:
        layout, page_size = "page_first", 4

        def __init__(self, dtype: torch.dtype):
            self.dtype = dtype
            x = torch.arange(2 * 12 * 3 * 2 * 2, dtype=torch.float32).reshape(2, 12, 3, 2, 2) / 8
            self.kv_buffer = x.to(dtype)

        def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
            page = self.kv_buffer[:, index:index + self.page_size]
            return page.flatten() if flat else page

    def page(p: MHAStandIn, i: int) -> torch.Tensor:
        return p.get_data_page(4 * i, flat=False).clone()

    plant = plant_mod.Plant(Path("/nonexistent"))
    starts, keys, ok = [0, 4, 8], [b"a", b"b", b"c"], [True, True, True]
    for mode in ("none", "donor"):
        pool = MHAStandIn(torch.bfloat16)
        before = pool.kv_buffer.clone()
        assert plant.apply(mode, pool, keys, starts, ok) == (0, "")
        assert torch.equal(pool.kv_buffer, before)

    pool = MHAStandIn(torch.bfloat16)
    old = [page(pool, i) for i in range(3)]
    assert plant.apply("shift", pool, keys, starts, ok) == (2, "")
    assert [torch.equal(page(pool, i), w) for i, w in enumerate([old[1], old[2], old[2]])] == [True] * 3

    for mode, ax in (("layers", 2), ("heads", 3)):
        pool = MHAStandIn(torch.bfloat16)
        old = [page(pool, i) for i in range(3)]
        assert plant.apply(mode, pool, keys, starts, ok) == (3, "")
        for i in range(3):
            new = page(pool, i)
            assert torch.equal(new.select(ax, 0), old[i].select(ax, 1))
            assert torch.equal(new.select(ax, 1), old[i].select(ax, 0))
            if mode == "layers":
                assert torch.equal(new.select(ax, 2), old[i].select(ax, 2))

    pool = MHAStandIn(torch.bfloat16)
    assert plant.apply("other-prompt", pool, keys, starts, ok)[0] == 0    # no donor kept yet
    plant.donors = [torch.full_like(page(pool, 0), 7.0), torch.full_like(page(pool, 0), 9.0)]
    old1 = page(pool, 1)
    assert plant.apply("other-prompt", pool, keys, starts, [True, False, True]) == (2, "")
    assert (page(pool, 0) == 7).all() and (page(pool, 2) == 9).all()
    assert torch.equal(page(pool, 1), old1)                # a missed page is left alone

    pool = MHAStandIn(torch.float8_e4m3fn)
    old = [page(pool, i).float() for i in range(3)]
    assert plant.apply("fp8-scale", pool, keys, starts, ok) == (3, "")
    for i in range(3):
        assert torch.equal(page(pool, i).float(), (old[i] * plant_mod.FP8_FACTOR).clamp(-448, 448))
    assert plant.apply("fp8-scale", MHAStandIn(torch.bfloat16), keys, starts, ok)[0] == 0


@needs_serving
@pytest.mark.timeout(900)
def test_demo_model_every_wrong_kv_mode_fails_the_logprob_check(
        servers: Callable[..., LaunchedServer], tmp_path: Path, demo_model: Path) -> None:
    plant = PlantControl(tmp_path / "plant")
    store = tmp_path / "store"
    s = servers(store, name="demo-wrong-kv", env=plant.env(), **NO_DECLINE)
    run = run_modes(s, store, plant, prompt(DEMO_TOKENS, 4701), prompt(DEMO_TOKENS, 4702),
                    ("none", *FAULTS, "none"), demo_model)
    check("demo model (bf16 KV)", run)


def _chat(model: Path, tokens: range, question: str) -> list[int]:
    """The model's chat template over README text (`tokens` of it) and a question: token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    ids = tok(readme, add_special_tokens=False)["input_ids"]
    assert len(ids) >= tokens.stop, (len(ids), tokens)
    doc = tok.decode(ids[tokens.start:tokens.stop])
    text = tok.apply_chat_template([{"role": "user", "content": f"{doc}\n\n{question}"}],
                                   tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


QUESTION_A = "What does this document say the product guarantees? Answer in one sentence."
QUESTION_B = "Which commands does this document describe? Answer in one sentence."


@needs_serving
@pytest.mark.timeout(1200)
def test_real_model_every_wrong_kv_mode_fails_the_logprob_check(
        servers: Callable[..., LaunchedServer], real_model: Path, tmp_path: Path) -> None:
    plant = PlantControl(tmp_path / "plant")
    store = tmp_path / "store"
    a = _chat(real_model, range(0, REAL_TOKENS), QUESTION_A)
    b = _chat(real_model, range(REAL_TOKENS, 2 * REAL_TOKENS), QUESTION_B)
    s = servers(store, name="real-wrong-kv", env=plant.env(), model=real_model, **NO_DECLINE)
    run = run_modes(s, store, plant, a, b, ("none", *FAULTS, "none"), real_model)
    check("real model (SmolLM2-135M-Instruct, bf16 KV)", run)


@needs_serving
@pytest.mark.timeout(900)
def test_real_model_fp8_kv_with_the_wrong_scale_fails_the_logprob_check(
        servers: Callable[..., LaunchedServer], real_model: Path, tmp_path: Path) -> None:
    """The reference is the L1 hit, not the cold reply: a cold prefill attends over its prompt's
    K/V before they are quantized to fp8, every cached serving after they are (measured here:
    cold vs L1 up to ~0.67 nats with the same tokens; an L3 hit equals an L1 hit bit for bit)."""
    plant = PlantControl(tmp_path / "plant")
    store = tmp_path / "store"
    a = _chat(real_model, range(0, REAL_TOKENS), QUESTION_A)
    s = servers(store, name="real-fp8-wrong-kv", env=plant.env(), model=real_model,
                sglang={"kv-cache-dtype": "fp8_e4m3"}, **NO_DECLINE)
    run = run_modes(s, store, plant, a, None, ("none", "fp8-scale", "none"), real_model,
                    reference="l1")
    check("real model (SmolLM2-135M-Instruct, fp8_e4m3 KV)", run)
