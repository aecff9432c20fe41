"""Patch 0018: a storage hit larger than the host room left waits for room instead of being trimmed.

One probe run (tests/distro/probe_l2_room.py, SGLANG_USE_CPU_ENGINE=1) against the wheel built from
patches/series, one against the reference: the same series less 0018 (`distro/shadow_tree.py
--without 0018`). The probe drives SGLang's own `UnifiedRadixCache` + host pool +
`HybridCacheController` with SGLang's `file` L3 on a temporary directory (or no L3) as the
scheduler does: a 16-page L3 hit arrives while 24 of the 33 host pages hold two finished
requests whose L3 write-backs are done but not yet acked (their pages still locked).

The reference trims the hit to the 9 free pages (144 of 256 tokens loaded, the tail recomputed);
with 0018, under the policies that hold the request for its load (wait_complete, timeout), the hit
waits one drain, the acks unlock those pages, evict_host frees them and the whole hit loads. Every
other cell answers as the reference: best_effort, the wait turned off
(SGLANG_HICACHE_STORAGE_HIT_HOST_ROOM_WAIT_TICKS=0), and HiCache without an L3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distro.conftest import REPO, load_script

HERE = Path(__file__).resolve().parent
PATCH = "0018"
HIT, ROOM = 256, 144   # the L3 hit and the host room free when it arrives, in tokens
CHANGED = ("file/wait_complete/default", "file/timeout/default")


def _probe(site: Path) -> dict:
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=str(site))
    env.pop("SGLANG_HICACHE_STORAGE_HIT_HOST_ROOM_WAIT_TICKS", None)
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
    shadow = load_script(REPO / "distro" / "shadow_tree.py", "sglang_offload_shadow_tree")
    out = tmp_path_factory.mktemp("without-0018") / "tree"
    applied = shadow.build(out, [PATCH])
    assert not any(p.name.startswith(PATCH) for p in applied)
    return out


@pytest.fixture(scope="module")
def patched(patched_site: Path) -> dict:
    return _probe(patched_site)


@pytest.fixture(scope="module")
def reference(reference_site: Path) -> dict:
    return _probe(reference_site)


def test_the_series_holds_the_patch(bw) -> None:
    assert [p.name for p in bw.read_series() if p.name.startswith(PATCH)]


def test_the_reference_trims_the_hit_to_the_host_room(reference: dict) -> None:
    """The fault the patch is for: the L3 holds 256 tokens, 144 are loaded, 112 recomputed."""
    for cell in CHANGED:
        assert reference[cell]["loaded"] == ROOM, reference[cell]


def test_the_whole_hit_loads_with_the_patch(patched: dict) -> None:
    for cell in CHANGED:
        loaded, (host_free, s_in_host) = patched[cell]["loaded"], patched[cell]["host"]
        assert loaded == HIT, patched[cell]
        assert s_in_host == HIT                     # inserted in the tree, all of it
        assert host_free > 0                        # the acked pages were evicted for it


def test_every_other_cell_answers_as_the_reference(patched: dict, reference: dict) -> None:
    assert sorted(patched) == sorted(reference)
    assert len(patched) == 2 * 3 * 2                # L3 x prefetch policy x wait ticks
    differ = {cell for cell in patched if patched[cell] != reference[cell]}
    assert differ == set(CHANGED)
    # best_effort (the request does not wait for its load) and ticks 0 trim as upstream
    assert all(patched[c]["loaded"] == ROOM for c in patched
               if c.startswith("file/") and c not in CHANGED)
    # no L3: the patched code is never reached
    assert all(patched[c]["loaded"] is None for c in patched if c.startswith("none/"))
