"""Patches 0002-0005: SGLang's CPU engine works without sgl_kernel, and HiCache moves KV with torch.

One probe run (tests/distro/probe_cpu_engine.py, SGLANG_USE_CPU_ENGINE=1) against the wheel built
from patches/series: the torch fallbacks equal the reference semantics on small tensors, the host
pools allocate without CUDA host registration, and every pool kind x layout x io backend round-trips
KV rows through SGLang's own host pool classes. On the unpatched wheel every check fails (no
sgl_kernel; NameError on transfer_kv_*).
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
from probe_cpu_engine import IO_BACKENDS, KINDS_LAYOUTS, ORDERS  # noqa: E402

pytestmark = pytest.mark.slow

# Mamba state slots are not pages: only the MHA and MLA pools take patch 0005's page copies.
ROUNDTRIPS = [f"{kind}/{layout}/{io}" + ("" if order == "pages" else f"/{order}")
              for kind, layouts in KINDS_LAYOUTS.items() for layout in layouts
              for io in IO_BACKENDS for order in (ORDERS if kind != "mamba" else ORDERS[:1])]


@pytest.fixture(scope="module")
def cpu_probe(patched_site) -> dict:
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=str(patched_site))
    result = subprocess.run([sys.executable, str(HERE / "probe_cpu_engine.py")], capture_output=True,
                            text=True, env=env, timeout=600)
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("PROBE ")]
    assert result.returncode == 0 and lines, f"probe failed:\n{result.stdout}\n{result.stderr}"
    return json.loads(lines[-1][len("PROBE "):])


@pytest.mark.parametrize("name", ["copy_all_layer_kv_cache", "assign_req_to_token_pool",
                                  "speculative_imports"])
def test_torch_fallbacks_match_the_reference(cpu_probe, name):
    assert cpu_probe["fallbacks"][name] == "ok", cpu_probe["fallbacks"][name]


def test_host_pools_skip_cuda_host_registration(cpu_probe):
    assert cpu_probe["host_pool"] == "ok", cpu_probe["host_pool"]


def test_whole_pages_are_told_from_other_indices(cpu_probe):
    """Patch 0005 copies whole pages at once, and only indices that are whole pages in order."""
    assert cpu_probe["whole_pages"] == "ok", cpu_probe["whole_pages"]


def test_every_pool_layout_and_io_backend_is_probed(cpu_probe):
    assert sorted(cpu_probe["roundtrip"]) == sorted(ROUNDTRIPS)


@pytest.mark.parametrize("case", ROUNDTRIPS)
def test_host_device_copies_round_trip(cpu_probe, case):
    assert cpu_probe["roundtrip"][case] == "ok", cpu_probe["roundtrip"][case]
