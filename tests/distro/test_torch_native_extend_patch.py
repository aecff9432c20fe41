"""Patch 0008: torch_native's extend attends only the new tokens' queries, with the same outputs.

One probe run (tests/distro/probe_torch_native_extend.py, in a fresh interpreter) against the
wheel built from patches/series, one against the unpatched upstream wheel. For each attention
shape (MHA/GQA, MLA's absorbed latent, a sliding window through the full->SWA slot map, cross
attention, a decoder over encoder tokens, encoder-only; small mask budgets forcing query blocks)
and dtype: no `scaled_dot_product_attention` call gets more queries than the request's new
tokens (upstream: the whole sequence for every request with a cached prefix), and the output
equals the unpatched computation within one rounding step of the dtype.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from probe_torch_native_extend import CASES, DTYPES  # noqa: E402

pytestmark = pytest.mark.slow

RUNS = [f"{case}/{dtype}" for case in CASES for dtype in DTYPES]
# the largest difference allowed, relative to the largest output: one rounding step
STEP = {"float32": 1e-5, "bfloat16": 2.0 ** -7}


def _probe(site: Path, cpu_engine: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("SGLANG_USE_CPU_ENGINE", None)
    if cpu_engine:   # the patched wheel as it serves on CPU; upstream then needs sgl_kernel
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    result = subprocess.run([sys.executable, str(HERE / "probe_torch_native_extend.py")],
                            capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("PROBE ")]
    assert result.returncode == 0 and lines, f"probe failed:\n{result.stdout}\n{result.stderr}"
    return json.loads(lines[-1][len("PROBE "):])


@pytest.fixture(scope="module")
def patched(patched_site) -> dict:
    return _probe(patched_site, True)


@pytest.fixture(scope="module")
def upstream(upstream_site) -> dict:
    return _probe(upstream_site, False)


def _query_lengths(run: dict) -> list[tuple[int, int]]:
    """(queries that reached SDPA, new tokens) per request: the calls of one request summed."""
    out, calls = [], iter(run["sdpa"])
    for extend in run["extend"]:
        got = 0
        while got < extend:
            got += next(calls)[0]
        out.append((got, extend))
    return out


@pytest.mark.parametrize("run", RUNS)
def test_only_the_new_queries_reach_sdpa(patched, run):
    result = patched[run]
    assert "error" not in result, result.get("error")
    assert all(q <= e for q, e in _query_lengths(result))
    assert all(q <= k for q, k in result["sdpa"])   # bottom-right: never more queries than keys


@pytest.mark.parametrize("run", RUNS)
def test_outputs_equal_the_unpatched_computation(patched, run):
    result = patched[run]
    assert "error" not in result, result.get("error")
    tol = STEP[run.split("/")[1]] * max(result["scale"], 1.0)
    assert result["max_diff"] <= tol, (result["max_diff"], tol)


def test_upstream_attends_the_whole_sequence(upstream):
    """The probe tells the two apart: upstream sends every position of a request with a cached
    prefix to SDPA (and agrees with the reference written out in the probe exactly)."""
    result = upstream["mha_gqa/float32"]
    assert "error" not in result, result.get("error")
    assert [q for q, _k in result["sdpa"]] == result["seq"]
    assert any(s > e for s, e in zip(result["seq"], result["extend"]))
    assert result["max_diff"] == 0.0
