"""patches/: the quilt series, DEP-3 headers, and that the series applies cleanly to the pinned wheel."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from datetime import date
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PATCHES = REPO / "patches"
REQUIRED_FIELDS = ("Description", "Author", "Origin", "Forwarded", "Last-Update", "X-Drop-When")


def dep3_header(patch: Path) -> dict[str, str]:
    """Fields of the DEP-3 header (the text before the first `--- ` line); continuations joined."""
    fields: dict[str, str] = {}
    current = None
    for line in patch.read_text(encoding="utf-8").splitlines():
        if line.startswith("--- ") or line == "---":
            break
        if line.startswith(" ") and current:
            fields[current] += "\n" + line.strip()
        elif m := re.match(r"^([A-Za-z-]+):\s*(.*)$", line):
            current = m.group(1)
            fields[current] = m.group(2)
    return fields


def touched_paths(patch: Path) -> list[str]:
    return [ln[4:].split("\t")[0] for ln in patch.read_text().splitlines() if ln.startswith("+++ ")]


def test_series_names_every_patch_exactly_once(bw):
    series = bw.read_series()
    assert series, "patches/series is empty"
    assert len({p.name for p in series}) == len(series)
    assert sorted(p.name for p in series) == sorted(p.name for p in PATCHES.glob("*.patch"))


@pytest.mark.parametrize("patch", sorted(PATCHES.glob("*.patch")), ids=lambda p: p.name)
def test_every_patch_has_a_dep3_header(patch: Path):
    fields = dep3_header(patch)
    missing = [f for f in REQUIRED_FIELDS if not fields.get(f, "").strip()]
    assert not missing, f"{patch.name}: DEP-3 fields missing: {missing}"
    assert date.fromisoformat(fields["Last-Update"]) <= date.today()
    assert "\n" in fields["Description"], "Description needs a synopsis and a long description"
    for path in touched_paths(patch):
        assert path.startswith("b/sglang/"), f"{patch.name}: {path} is not relative to the wheel root"


def test_series_applies_cleanly_to_the_pinned_wheel(bw, pinned_wheel, tmp_path):
    """With `patch -p1 --fuzz=0`: every hunk applies at its stated line (no offset, no fuzz)."""
    if shutil.which("patch") is None:
        pytest.skip("the `patch` program is not installed (the Python applier test still runs)")
    notes = bw.patch_tree(pinned_wheel, tmp_path / "tree", bw.read_series(), applier="patch",
                          only_touched=True)
    assert notes == []


def test_python_applier_gives_the_same_tree_as_patch(bw, pinned_wheel, tmp_path):
    series = bw.read_series()
    notes = bw.patch_tree(pinned_wheel, tmp_path / "py", series, applier="python", only_touched=True)
    assert notes == []
    touched = {p[len("b/"):] for patch in series for p in touched_paths(patch)}
    if shutil.which("patch") is not None:
        bw.patch_tree(pinned_wheel, tmp_path / "gnu", series, applier="patch", only_touched=True)
        for path in touched:
            assert (tmp_path / "py" / path).read_bytes() == (tmp_path / "gnu" / path).read_bytes()
    import zipfile

    with zipfile.ZipFile(pinned_wheel) as zf:
        upstream = set(zf.namelist())
        for path in touched:  # every patched file really changed (or is new)
            if path in upstream:
                assert (tmp_path / "py" / path).read_bytes() != zf.read(path)
            else:
                assert (tmp_path / "py" / path).is_file()


def test_check_command_reports_a_clean_series(pinned_wheel):
    result = subprocess.run(
        [sys.executable, str(REPO / "distro" / "build_wheel.py"), "--check", "--from-file",
         str(pinned_wheel)], capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "applies cleanly" in result.stdout


def test_a_patch_that_does_not_apply_stops_the_build(bw, pinned_wheel, tmp_path):
    bad = tmp_path / "9999-bad.patch"
    bad.write_text(
        "Description: does not apply\n---\n"
        "--- a/sglang/version.py\n+++ b/sglang/version.py\n"
        "@@ -1,1 +1,1 @@\n-this line is not in the file\n+replacement\n"
    )
    for applier in ("python", "patch") if shutil.which("patch") else ("python",):
        with pytest.raises(bw.BuildError, match="9999-bad.patch does not apply"):
            bw.patch_tree(pinned_wheel, tmp_path / applier, [bad], applier=applier, only_touched=True)
