"""distro/shadow_tree.py: the patched SGLang less named patches, for before/after runs of one patch.

The tree is what `PYTHONPATH=DIR` puts in front of .venv's SGLang for the benchmarks' "before"
runs: it must hold the series less exactly the patches named (the file a left-out patch changes is
upstream's), record that in OFFLOAD_PATCHES (what `bench serve` reads), and refuse names that are
not exactly one patch of the series.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.distro.conftest import REPO, load_script

pytestmark = pytest.mark.slow

SHADOW = REPO / "distro" / "shadow_tree.py"
TORCH_NATIVE = "sglang/srt/layers/attention/torch_native_backend.py"


@pytest.fixture(scope="module")
def shadow():
    return load_script(SHADOW, "sglang_offload_shadow_tree")


def test_names_must_match_one_patch_each(shadow, bw):
    series = bw.read_series()
    assert [p.name for p in shadow.select(series, ["0008"])] == [
        p.name for p in series if not p.name.startswith("0008")]
    for bad in ("0009", "00", "not-a-patch"):
        with pytest.raises(ValueError, match=f"--without '{bad}' matches"):
            shadow.select(series, [bad])


def test_tree_lacks_exactly_the_named_patch(shadow, bw, pinned_wheel, upstream_site, tmp_path):
    out = tmp_path / "no-0008"
    result = subprocess.run([sys.executable, str(SHADOW), "--without", "0008", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    # the file 0008 patches is upstream's (0007 touches it too: compare with 0007 applied alone)
    only_0007 = tmp_path / "only-0007"
    bw.patch_tree(pinned_wheel, only_0007, [p for p in bw.read_series() if p.name.startswith("0007")],
                  only_touched=True)
    assert (out / TORCH_NATIVE).read_bytes() == (only_0007 / TORCH_NATIVE).read_bytes()
    assert (out / TORCH_NATIVE).read_bytes() != (upstream_site / TORCH_NATIVE).read_bytes()
    record = next(out.glob("sglang-*.dist-info")).joinpath("OFFLOAD_PATCHES").read_text()
    names = [line.split()[-1] for line in record.splitlines() if line.strip() and not line.startswith("#")]
    assert names == [p.name for p in bw.read_series() if not p.name.startswith("0008")]
    # a second run replaces the tree; a directory it did not make is refused
    again = subprocess.run([sys.executable, str(SHADOW), "--without", "0016", "--out", str(out)],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    refused = subprocess.run([sys.executable, str(SHADOW), "--without", "0008", "--out",
                              str(tmp_path / "mine")], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "not a tree this script made" in refused.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
