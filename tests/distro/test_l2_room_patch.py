"""Patch 0018: a storage hit larger than the host room left waits for room instead of being trimmed.

One probe run (tests/distro/probe_l2_room.py, SGLANG_USE_CPU_ENGINE=1) against the wheel built from
patches/series, one against the reference: the same series less 0018 (`distro/shadow_tree.py
--without 0018`). The probe drives SGLang's own `UnifiedRadixCache` + host pool +
`HybridCacheController` with SGLang's `file` L3 on a temporary directory (or no L3) as the
scheduler does: a 16-page L3 hit arrives while 24 of the 33 host pages hold two finished
requests whose L3 write-backs are done but not yet acked (their pages still locked).

Two pressures (see the probe): host pages locked by write-backs whose acks are not drained yet
(`acks`), and host pages that are copies of device pages, write_through (`device`). The reference
trims the hit to the free host room and recomputes the tail (144 of 256 tokens, 80 of 192). With
0018: locked pages, under the policies that hold the request for its load (wait_complete,
timeout), the hit waits one drain, the acks unlock those pages, evict_host frees them and the whole
hit loads; device copies, under every policy, the least recently used unlocked device pages are
demoted and their host copies evicted (they are in the L3) and the whole hit loads. Every other
cell answers as the reference: locked pages under best_effort or with the wait turned off
(SGLANG_HICACHE_STORAGE_HIT_HOST_ROOM_WAIT_TICKS=0), device copies with
SGLANG_HICACHE_SKIP_HOST_DUPLICATE_RECLAIM=1, and HiCache without an L3.
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
PATCH = "0018"
# cell -> (tokens the reference loads, tokens 0018 loads) where they differ; the hit is 256 tokens
# (acks) or 192 (device)
CHANGED = {
    "file/acks/wait_complete/default": (144, 256),
    "file/acks/timeout/default": (144, 256),
    **{f"file/device/{policy}/{ticks}": (80, 192)
       for policy in ("wait_complete", "timeout", "best_effort") for ticks in ("default", "0")},
}


def _probe(site: Path) -> dict:
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=str(site))
    for name in ("SGLANG_HICACHE_STORAGE_HIT_HOST_ROOM_WAIT_TICKS",
                 "SGLANG_HICACHE_SKIP_HOST_DUPLICATE_RECLAIM"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, str(HERE / "probe_l2_room.py")], capture_output=True,
                            text=True, env=env, timeout=900, cwd=REPO)
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("PROBE ")]
    assert result.returncode == 0 and lines, f"probe failed:\n{result.stdout}\n{result.stderr}"
    cells = json.loads(lines[-1][len("PROBE "):])["cells"]
    for cell, value in cells.items():
        assert "error" not in value, f"{cell}:\n{value['error']}"
    return cells


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


def test_the_reference_trims_the_hit_to_the_host_room(reference: dict) -> None:
    """The fault the patch is for: the L3 holds the whole hit, the host room left is loaded, the
    tail recomputed."""
    for cell, (trimmed, _) in CHANGED.items():
        assert reference[cell]["loaded"] == trimmed, (cell, reference[cell])


def test_the_whole_hit_loads_with_the_patch(patched: dict) -> None:
    for cell, (_, whole) in CHANGED.items():
        loaded, (host_free, s_in_host) = patched[cell]["loaded"], patched[cell]["host"]
        assert loaded == whole, (cell, patched[cell])
        assert s_in_host == whole                   # inserted in the tree, all of it
        assert host_free > 0                        # room was taken for it, not just found


def test_every_other_cell_answers_as_the_reference(patched: dict, reference: dict) -> None:
    assert sorted(patched) == sorted(reference)
    assert len(patched) == 3 * 3 * 2 + 1            # (L3, pressure) x policy x ticks, + skip
    differ = {cell for cell in patched if patched[cell] != reference[cell]}
    assert differ == set(CHANGED)
    # locked pages: best_effort (the request does not wait for its load) and ticks 0 trim
    assert all(patched[c]["loaded"] == 144 for c in patched
               if c.startswith("file/acks/") and c not in CHANGED)
    # device copies: SGLANG_HICACHE_SKIP_HOST_DUPLICATE_RECLAIM=1 keeps upstream's eviction
    assert patched["file/device/best_effort/skip-reclaim"]["loaded"] == 80
    # no L3: the patched code is never reached
    assert all(patched[c]["loaded"] is None for c in patched if c.startswith("none/"))
