"""A strict, pure-Python applier for unified diffs (the fallback when `patch` is not installed).

Primitives: `parse_patch(text) -> list[FilePatch]` reads every file section of a unified diff (any
text before the first `--- ` line, such as a DEP-3 header, is skipped); `apply_patch(path, root,
strip)` applies one patch file inside `root` like `patch -p<strip> --fuzz=0` and returns one line per
hunk that had to move (its offset); `PatchError` names the file and hunk that did not apply.

Context must match exactly (no fuzz); a hunk may move by an offset, which is reported. Every hunk of
every file is checked before anything is written, so a patch either applies completely or leaves
the tree untouched. Handles file creation and deletion (/dev/null) and `\\ No newline at end of
file`.

Run as a script: `python distro/apply_patch.py -p1 -d TREE PATCHFILE...`.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_DEV_NULL = "/dev/null"


class PatchError(Exception):
    """A patch is malformed or does not apply; the message names the file and the hunk."""


@dataclass
class Hunk:
    """One `@@` block: where it claims to start, the lines it expects and the lines it leaves."""

    old_start: int
    old_lines: list[str] = field(default_factory=list)
    new_lines: list[str] = field(default_factory=list)


@dataclass
class FilePatch:
    """The hunks for one file; `old_path` / `new_path` are as written (a/..., b/... or /dev/null)."""

    old_path: str
    new_path: str
    hunks: list[Hunk] = field(default_factory=list)

    def target(self, strip: int) -> str:
        """The path inside the tree after removing `strip` leading components."""
        path = self.new_path if self.new_path != _DEV_NULL else self.old_path
        parts = path.split("/")
        if len(parts) <= strip:
            raise PatchError(f"cannot strip {strip} components from {path!r}")
        return "/".join(parts[strip:])


def split_lines(text: str) -> list[str]:
    """Split on "\\n" only, keeping it (str.splitlines also splits on form feeds and others)."""
    parts = text.split("\n")
    lines = [part + "\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def _path_of(line: str) -> str:
    # "--- a/x/y.py\t2026-01-01 ..." -> "a/x/y.py"
    return line[4:].rstrip("\n").split("\t")[0].strip()


def _counts(match: re.Match[str]) -> tuple[int, int, int]:
    old_start = int(match.group(1))
    old_count = int(match.group(2)) if match.group(2) is not None else 1
    new_count = int(match.group(4)) if match.group(4) is not None else 1
    return old_start, old_count, new_count


def parse_patch(text: str) -> list[FilePatch]:
    """Parse every file section of a unified diff; raise PatchError on a malformed hunk."""
    lines = split_lines(text)
    files: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not (line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")):
            i += 1
            continue
        current = FilePatch(_path_of(line), _path_of(lines[i + 1]))
        files.append(current)
        i += 2
        while i < len(lines) and (m := _HUNK_RE.match(lines[i])):
            old_start, old_left, new_left = _counts(m)
            hunk = Hunk(old_start)
            current.hunks.append(hunk)
            i += 1
            while i < len(lines) and (old_left > 0 or new_left > 0):
                body = lines[i]
                tag, content = body[:1], body[1:]
                if tag == "\n":  # a context line whose single space was trimmed
                    tag, content = " ", "\n"
                if tag == " ":
                    targets = [hunk.old_lines, hunk.new_lines]
                    old_left, new_left = old_left - 1, new_left - 1
                elif tag == "-":
                    targets = [hunk.old_lines]
                    old_left -= 1
                elif tag == "+":
                    targets = [hunk.new_lines]
                    new_left -= 1
                else:
                    raise PatchError(
                        f"{current.new_path}: unexpected line in hunk at -{hunk.old_start}: {body!r}"
                    )
                # "\ No newline at end of file" follows the line it applies to.
                no_newline = i + 1 < len(lines) and lines[i + 1].startswith("\\")
                for target in targets:
                    target.append(content.removesuffix("\n") if no_newline else content)
                i += 2 if no_newline else 1
            if old_left != 0 or new_left != 0:
                raise PatchError(f"{current.new_path}: hunk at -{hunk.old_start} is truncated")
    if not files:
        raise PatchError("no file sections (--- / +++) found")
    return files


def _find(lines: list[str], expected: list[str], start: int) -> int | None:
    """Index where `expected` occurs in `lines`, nearest to `start` first; None if nowhere."""
    if not expected:
        return min(max(start, 0), len(lines))
    for delta in range(0, len(lines) + 1):
        for pos in ((start + delta, start - delta) if delta else (start,)):
            if 0 <= pos <= len(lines) - len(expected) and lines[pos : pos + len(expected)] == expected:
                return pos
    return None


def patch_lines(name: str, lines: list[str], fp: FilePatch) -> tuple[list[str], list[str]]:
    """Apply one file's hunks to its lines; return (new lines, notes about offsets)."""
    out = list(lines)
    notes: list[str] = []
    shift = 0  # how far earlier hunks moved the following text
    for number, hunk in enumerate(fp.hunks, start=1):
        wanted = hunk.old_start - 1 + shift if hunk.old_lines else hunk.old_start + shift
        pos = _find(out, hunk.old_lines, max(wanted, 0))
        if pos is None:
            raise PatchError(f"{name}: hunk #{number} (at -{hunk.old_start}) does not apply")
        if pos != wanted:
            notes.append(f"{name}: hunk #{number} applied at offset {pos - wanted}")
        out[pos : pos + len(hunk.old_lines)] = hunk.new_lines
        shift += len(hunk.new_lines) - len(hunk.old_lines) + (pos - wanted)
    return out, notes


def apply_patch(patch_file: Path, root: Path, strip: int = 1) -> list[str]:
    """Apply `patch_file` inside `root` (all or nothing); return notes on hunks that moved."""
    files = parse_patch(patch_file.read_bytes().decode("utf-8"))
    pending: list[tuple[Path, list[str] | None]] = []
    notes: list[str] = []
    for fp in files:
        name = fp.target(strip)
        path = root / name
        creating = fp.old_path == _DEV_NULL
        if creating and path.exists():
            raise PatchError(f"{name}: the patch creates it, but it already exists")
        if not creating and not path.is_file():
            raise PatchError(f"{name}: no such file in {root}")
        old = [] if creating else split_lines(path.read_bytes().decode("utf-8"))
        new, moved = patch_lines(name, old, fp)
        notes.extend(moved)
        deleting = fp.new_path == _DEV_NULL
        if deleting and new:
            raise PatchError(f"{name}: the patch deletes it, but lines would remain")
        pending.append((path, None if deleting else new))
    for path, new in pending:
        if new is None:
            path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes("".join(new).encode("utf-8"))
    return notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-p", dest="strip", type=int, default=1, help="leading path components")
    parser.add_argument("-d", dest="root", type=Path, default=Path("."), help="tree to patch")
    parser.add_argument("patches", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for patch_file in args.patches:
        try:
            for note in apply_patch(patch_file, args.root, args.strip):
                print(note)
        except (PatchError, OSError) as exc:
            print(f"error: {patch_file}: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
