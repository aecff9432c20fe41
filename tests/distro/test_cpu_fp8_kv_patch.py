"""Patch 0017: a CPU FP8 KV cache passes SGLang's gate with torch_native attention, and only there.

One probe run (tests/distro/probe_cpu_fp8_kv.py, SGLANG_USE_CPU_ENGINE=1) against the wheel built
from patches/series, one against the reference: the same series less 0017
(`distro/shadow_tree.py --without 0017`). Every cell of KV dtype x MLA x attention backends x AMX
gets the reference's answer, error message included, except the two the patch is for (fp8, MHA,
torch_native only, with or without AMX), where the reference refuses and the patched wheel passes.
torch_native's read path (upstream, untouched) attends fp8 K/V as their bfloat16 values. The fp8
host<->device page copies (patch 0005) are in test_cpu_engine_patches.py; serving it, through
`launch`, in tests/e2e/test_fp8_kv_cache.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distro.conftest import REPO, site_without

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
PATCH = "0017"
# the cells where 0017 changes the answer: the reference's refusal there
CHANGED = {
    "fp8_e4m3/mha/torch_native/no-amx": "ValueError: CPU FP8 KV cache requires Intel AMX support.",
    "fp8_e4m3/mha/torch_native/amx":
        "ValueError: CPU FP8 KV cache requires the intel_amx attention backend.",
}


def _probe(site: Path) -> dict:
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=str(site))
    result = subprocess.run([sys.executable, str(HERE / "probe_cpu_fp8_kv.py")], capture_output=True,
                            text=True, env=env, timeout=600, cwd=REPO)
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("PROBE ")]
    assert result.returncode == 0 and lines, f"probe failed:\n{result.stdout}\n{result.stderr}"
    return json.loads(lines[-1][len("PROBE "):])


@pytest.fixture(scope="module")
def reference_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return site_without(tmp_path_factory, PATCH)


@pytest.fixture(scope="module")
def patched(patched_site: Path) -> dict:
    return _probe(patched_site)


@pytest.fixture(scope="module")
def reference(reference_site: Path) -> dict:
    return _probe(reference_site)


def test_the_series_holds_the_patch(bw) -> None:
    assert [p.name for p in bw.read_series() if p.name.startswith(PATCH)]


def test_the_reference_refuses_fp8_without_amx(reference: dict) -> None:
    """The fault the patch is for: upstream refuses torch_native on a CPU without AMX."""
    for cell, refusal in CHANGED.items():
        assert reference["gate"][cell] == refusal


def test_torch_native_passes_the_gate_with_the_patch(patched: dict) -> None:
    for cell in CHANGED:
        assert patched["gate"][cell] == "passes", patched["gate"][cell]


def test_every_other_cell_answers_as_the_reference(patched: dict, reference: dict) -> None:
    assert sorted(patched["gate"]) == sorted(reference["gate"])
    assert len(patched["gate"]) == 2 * 2 * 4 * 2
    differ = {cell for cell in patched["gate"] if patched["gate"][cell] != reference["gate"][cell]}
    assert differ == set(CHANGED)
    # bf16 always passes; MLA fp8 is still refused; intel_amx still needs AMX
    assert all(v == "passes" for k, v in patched["gate"].items() if k.startswith("bfloat16/"))
    assert all(v.endswith("only supported for MHA.") for k, v in patched["gate"].items()
               if k.startswith("fp8_e4m3/mla/"))
    assert patched["gate"]["fp8_e4m3/mha/intel_amx/no-amx"] == (
        "ValueError: CPU FP8 KV cache requires Intel AMX support.")


def test_torch_native_attends_fp8_kv_in_the_model_dtype(patched: dict, reference: dict) -> None:
    assert patched["read"] == "ok", patched["read"]
    assert reference["read"] == "ok", reference["read"]   # upstream's read path, untouched
