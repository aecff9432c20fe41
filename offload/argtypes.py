"""Value checks for command-line options: each runs while the arguments are parsed, before any work.

Each check takes the option's text and returns its value, or raises ValueError saying what is
wrong and what is allowed; `arg(check)` turns that into argparse's message, so a bad value is one
`error: argument --opt: ...` line and exit 2 (cli.py). Benchmark modules name these checks in
their `Option` declarations (`offload.bench.common`) without importing argparse.

- `count` (an integer >= 1), `natural` (>= 0), `positive` (a number > 0);
- `size` (bytes > 0, e.g. 256MiB), `size_list` (comma-separated sizes, returned as given: the
  benchmark splits it), `names(*known)` (comma-separated names out of `known`, returned as given);
- `work_dir` (an existing, writable directory), `plot_file` (a file in an existing, writable
  directory, with an image format matplotlib writes; matplotlib is imported only here).
"""

from __future__ import annotations

import argparse
import os
from typing import Callable, TypeVar

from offload.config import Size

T = TypeVar("T")


def arg(check: Callable[[str], T]) -> Callable[[str], T]:
    """`check` as an argparse `type=`: its ValueError becomes the one-line usage error."""
    def convert(text: str) -> T:
        try:
            return check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None

    convert.__name__ = getattr(check, "__name__", "value")
    return convert


def _int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError("not an integer") from None


def count(text: str) -> int:
    """An integer >= 1 (blocks per batch, threads, tries)."""
    n = _int(text)
    if n < 1:
        raise ValueError("must be at least 1")
    return n


def natural(text: str) -> int:
    """An integer >= 0 (0: skip)."""
    n = _int(text)
    if n < 0:
        raise ValueError("cannot be negative (0 skips it)")
    return n


def positive(text: str) -> float:
    """A finite number > 0."""
    try:
        x = float(text)
    except ValueError:
        raise ValueError("not a number") from None
    if not 0 < x < float("inf"):
        raise ValueError("must be a number greater than 0")
    return x


def size(text: str) -> int:
    """Bytes > 0: `268435456`, `256MiB`, `1.5GB`."""
    n = int(Size.parse(text))
    if n <= 0:
        raise ValueError("must be more than 0 bytes")
    return n


def size_list(text: str) -> str:
    """Comma-separated sizes, each > 0 (returned as given)."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError("name at least one size, e.g. 1MiB,4MiB")
    for p in parts:
        try:
            size(p)
        except ValueError as e:
            raise ValueError(f"{p!r} is not {e}" if "a size" in str(e) else f"{p!r} {e}") from None
    return text


def names(*known: str) -> Callable[[str], str]:
    """Comma-separated names, each one of `known` (returned as given)."""
    def check(text: str) -> str:
        got = [p.strip() for p in text.split(",") if p.strip()]
        bad = [p for p in got if p not in known]
        if bad or not got:
            what = f"unknown {', '.join(map(repr, bad))}" if bad else "empty"
            raise ValueError(f"{what}; choose from {','.join(known)}")
        return text

    check.__name__ = "names"
    return check


def work_dir(text: str) -> str:
    """An existing directory this process may create files in."""
    if not os.path.exists(text):
        raise ValueError("does not exist; create it first (mkdir -p) or leave the option out")
    if not os.path.isdir(text):
        raise ValueError("is not a directory")
    if not os.access(text, os.W_OK | os.X_OK):
        raise ValueError("is not writable by this user")
    return text


def work_dirs(text: str) -> tuple[str, ...]:
    """Two or more comma-separated existing, writable, distinct directories (one per drive)."""
    dirs = [d.strip() for d in text.split(",") if d.strip()]
    if len(dirs) < 2:
        raise ValueError("name two or more directories, comma-separated (one per drive)")
    for d in dirs:
        try:
            work_dir(d)
        except ValueError as e:
            raise ValueError(f"{d!r} {e}") from None
    if len({os.path.realpath(d) for d in dirs}) < len(dirs):
        raise ValueError("names one directory twice")
    return tuple(dirs)


def plot_formats() -> list[str]:
    """The file extensions matplotlib can write (ValueError when matplotlib is missing)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ValueError("plots need matplotlib: .venv/bin/pip install -e '.[plot]' "
                         "(docs/install.md)") from None
    return sorted(FigureCanvasBase.get_supported_filetypes())


def plot_file(text: str) -> str:
    """Where a plot goes: a file name whose directory exists and is writable, with a known format."""
    if not text or os.path.isdir(text):
        raise ValueError("name a file such as OUT.png")
    where = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(where):
        raise ValueError(f"directory {where} does not exist")
    if not os.access(where, os.W_OK | os.X_OK):
        raise ValueError(f"directory {where} is not writable by this user")
    ext = os.path.splitext(text)[1].lstrip(".").lower()
    formats = plot_formats()
    if ext not in formats:
        raise ValueError(f"format {'.' + ext if ext else '(no extension)'} is not one matplotlib "
                         f"writes; use .png or one of {', '.join(formats)}")
    return text
