"""What every benchmark shares: declared options, its outcome, timing, medians and the page cache.

Primitives:
- `Option(flags, help, ...)`: one command-line option of a benchmark, declared as data; each
  benchmark module lists its own in `OPTIONS` and `offload.commands.bench` turns them into flags
  (no benchmark imports argparse). `Args`: what `run` receives (one attribute per option).
- `Outcome(result, rc)`: what a benchmark's `run(args)` returns: the result it printed (drawn by
  `--plot`) and its exit code.
- `timed(fn)` -> seconds; `timed_cpu(fn)` -> (seconds, CPU seconds of this process, fn's value).
- `median_of(tries)`: the leaf-wise median of same-shaped results (dicts of numbers).
- `drop_cache(directory, suffix)`: evict the files' pages from the page cache (a cold read on a
  buffered file system); `fsync_files(directory, suffix)`: fsync the files and the directory.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Option:
    """One option: `flags` as argparse takes them ("--pages" or a positional "result"); `flag`
    makes it a switch (store_true); `type` converts the text; `choices` limits the values."""
    flags: tuple[str, ...]
    help: str
    default: Any = None
    type: Callable[[str], Any] | None = None
    choices: Sequence[str] | None = None
    flag: bool = False
    required: bool = False
    metavar: str | None = None


class Args(Protocol):
    """The parsed options: one attribute per `Option` (named by its first long flag)."""

    def __getattr__(self, name: str) -> Any: ...


@dataclass
class Outcome:
    result: dict[str, Any] | None      # what `--json` prints and `--plot` draws (None: nothing)
    rc: int = 0                        # 0 ok, 1 a `--check`-style target missed


JSON = Option(("--json",), "print one JSON object", flag=True)


def timed(fn: Callable[[], object]) -> float:
    """Wall-clock seconds of one call."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def timed_cpu(fn: Callable[[], T]) -> tuple[float, float, T]:
    """(wall seconds, CPU seconds of this process — all its threads —, the call's value)."""
    cpu0, t0 = time.process_time(), time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, time.process_time() - cpu0, value


def median_of(tries: Sequence[Any]) -> Any:
    """Leaf-wise median of the same-shaped results of several tries (numbers at the leaves;
    anything else is taken from the first try)."""
    first = tries[0]
    if isinstance(first, dict):
        return {k: median_of([t[k] for t in tries if isinstance(t, dict) and k in t])
                for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return statistics.median(tries)
    return first


def _each(directory: str, suffix: str, fn: Callable[[int], None]) -> None:
    for name in os.listdir(directory):
        if name.endswith(suffix):
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                fn(fd)
            finally:
                os.close(fd)


def drop_cache(directory: str, suffix: str) -> None:
    """Drop the page-cache pages of the files named *suffix in `directory`."""
    _each(directory, suffix, lambda fd: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED))


def fsync_files(directory: str, suffix: str) -> None:
    """fsync every file named *suffix in `directory`, then the directory (its entries)."""
    _each(directory, suffix, os.fsync)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
