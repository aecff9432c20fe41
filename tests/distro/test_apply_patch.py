"""distro/apply_patch.py, the pure-Python fallback for `patch -p1 --fuzz=0`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ORIGINAL = "".join(f"line {i}\n" for i in range(1, 21))

CHANGE = """Description: header text is skipped
---
--- a/pkg/mod.py
+++ b/pkg/mod.py
@@ -4,3 +4,4 @@
 line 4
-line 5
+line five
+line five and a half
 line 6
@@ -15,3 +16,3 @@
 line 15
-line 16
+line sixteen
 line 17
"""


def write(root: Path, name: str, text: str) -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def expected_after_change() -> str:
    lines = ORIGINAL.splitlines(keepends=True)
    lines[4:5] = ["line five\n", "line five and a half\n"]
    lines[16] = "line sixteen\n"
    return "".join(lines)


def test_applies_hunks_at_their_lines(apply_mod, tmp_path):
    write(tmp_path, "pkg/mod.py", ORIGINAL)
    patch = write(tmp_path, "x.patch", CHANGE)
    assert apply_mod.apply_patch(patch, tmp_path, 1) == []
    assert (tmp_path / "pkg/mod.py").read_text() == expected_after_change()


def test_reports_an_offset_when_text_moved(apply_mod, tmp_path):
    write(tmp_path, "pkg/mod.py", "new first line\n" + ORIGINAL)
    patch = write(tmp_path, "x.patch", CHANGE)
    notes = apply_mod.apply_patch(patch, tmp_path, 1)
    assert notes == ["pkg/mod.py: hunk #1 applied at offset 1"]  # hunk #2 follows hunk #1
    assert (tmp_path / "pkg/mod.py").read_text() == "new first line\n" + expected_after_change()


def test_changed_context_is_refused_and_nothing_is_written(apply_mod, tmp_path):
    write(tmp_path, "pkg/mod.py", ORIGINAL.replace("line 17", "line 17 edited"))
    write(tmp_path, "pkg/other.py", "a\n")
    two_files = CHANGE + "--- a/pkg/other.py\n+++ b/pkg/other.py\n@@ -1 +1 @@\n-a\n+b\n"
    patch = write(tmp_path, "x.patch", "--- a/pkg/other.py\n+++ b/pkg/other.py\n@@ -1 +1 @@\n-a\n+b\n"
                  + two_files[two_files.index("--- a/pkg/mod.py"):])
    with pytest.raises(apply_mod.PatchError, match=r"pkg/mod.py: hunk #2 \(at -15\) does not apply"):
        apply_mod.apply_patch(patch, tmp_path, 1)
    assert (tmp_path / "pkg/other.py").read_text() == "a\n"  # all or nothing


def test_creates_and_deletes_files_and_keeps_missing_final_newline(apply_mod, tmp_path):
    write(tmp_path, "gone.txt", "bye\n")
    write(tmp_path, "tail.txt", "one\ntwo")
    patch = write(tmp_path, "x.patch", (
        "--- /dev/null\n+++ b/new/file.txt\n@@ -0,0 +1,2 @@\n+hello\n+world\n"
        "--- a/gone.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-bye\n"
        "--- a/tail.txt\n+++ b/tail.txt\n@@ -1,2 +1,2 @@\n one\n-two\n\\ No newline at end of file\n"
        "+three\n\\ No newline at end of file\n"
    ))
    assert apply_mod.apply_patch(patch, tmp_path, 1) == []
    assert (tmp_path / "new/file.txt").read_text() == "hello\nworld\n"
    assert not (tmp_path / "gone.txt").exists()
    assert (tmp_path / "tail.txt").read_bytes() == b"one\nthree"


def test_form_feeds_are_not_line_breaks(apply_mod, tmp_path):
    write(tmp_path, "f.py", "a\x0cb\nc\n")
    patch = write(tmp_path, "x.patch", "--- a/f.py\n+++ b/f.py\n@@ -1,2 +1,2 @@\n a\x0cb\n-c\n+d\n")
    apply_mod.apply_patch(patch, tmp_path, 1)
    assert (tmp_path / "f.py").read_text() == "a\x0cb\nd\n"


def test_agrees_with_gnu_patch_on_a_diff_u_output(apply_mod, tmp_path):
    if shutil.which("patch") is None or shutil.which("diff") is None:
        pytest.skip("GNU patch/diff not installed")
    a, b = tmp_path / "a", tmp_path / "b"
    write(a, "m.py", ORIGINAL)
    write(b, "m.py", expected_after_change().replace("line 1\n", "first\n") + "appended\n")
    diff = subprocess.run(["diff", "-u", "--label", "a/m.py", "--label", "b/m.py",
                           str(a / "m.py"), str(b / "m.py")], capture_output=True, text=True).stdout
    patch = write(tmp_path, "x.patch", diff)
    for tool in ("py", "gnu"):
        write(tmp_path / tool, "m.py", ORIGINAL)
    apply_mod.apply_patch(patch, tmp_path / "py", 1)
    subprocess.run(["patch", "-p1", "--fuzz=0", "-s", "-d", str(tmp_path / "gnu"), "-i", str(patch)],
                   check=True)
    assert (tmp_path / "py/m.py").read_text() == (tmp_path / "gnu/m.py").read_text()
    assert (tmp_path / "py/m.py").read_text() == (b / "m.py").read_text()
