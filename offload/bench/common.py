"""What every benchmark shares: declared options, its outcome, timing, medians and the page cache.

Primitives:
- `Option(flags, help, ...)`: one command-line option of a benchmark, declared as data; each
  benchmark module lists its own in `OPTIONS` and `offload.commands.bench` turns them into flags
  (no benchmark imports argparse); its `type` is a check of `offload.argtypes` (a bad
  value is refused while parsing, before any work). `Args`: what `run` receives (one attribute
  per option). `JSON`, `PLOT`, `DIR`: options several benchmarks share.
- `Outcome(result, rc)`: what a benchmark's `run(args)` returns: the result it printed (drawn by
  `--plot`) and its exit code.
- `timed(fn)` -> seconds; `timed_cpu(fn)` -> (seconds, CPU seconds of this process, fn's value).
- `median_of(tries)`: the leaf-wise median of same-shaped results (dicts of numbers).
- `scratch(parent, prefix, keep)`: a private temporary directory (mode 0700) under `parent`, removed
  with everything in it on exit, whatever the benchmark wrote there.
- `drop_cache(directory, suffix)`: evict the files' pages from the page cache (a cold read on a
  buffered file system); `fsync_files(directory, suffix)`: fsync the files and the directory.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence, TypeVar

from offload.argtypes import plot_file, work_dir

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
PLOT = Option(("--plot",), "draw the result as an image (each target's --help says what it "
              "shows: offload.commands.bench.PLOTS); the directory must exist, the extension "
              "names the format", None, plot_file, metavar="OUT.png")
log = logging.getLogger("offload.bench")


def dir_option(what: str) -> Option:
    """`--dir`: an existing writable directory on the disk to measure; the benchmark works in a
    private directory it creates there and removes at the end."""
    return Option(("--dir",), f"{what} (default: a temporary directory under $TMPDIR); the "
                  "benchmark writes in a directory of its own there and removes it at the end",
                  None, work_dir)


@contextmanager
def scratch(parent: str | None, prefix: str, keep: bool = False) -> Iterator[str]:
    """A new directory under `parent` (default $TMPDIR), removed with its contents on exit; with
    `keep` left in place, its path printed."""
    root = tempfile.mkdtemp(prefix=prefix, dir=parent)
    log.debug("working in %s", root)
    if keep:
        print(f"keeping {root}", file=sys.stderr)
        yield root
        return
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
        log.debug("removed %s", root)


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


def put_all(store: Any, keys: Sequence[bytes], views: Sequence[Any], batch: int, what: str) -> None:
    """Put every key in batches (the i-th key of a batch from `views[i]`), then wait until they
    are durable: a store's put figure is time to durable. RuntimeError naming `what` if not."""
    for i in range(0, len(keys), batch):
        ks = keys[i:i + batch]
        if not all(store.put_many(ks, [[v] for v in views[:len(ks)]])):
            raise RuntimeError(f"put failed at {what}")
    if not store.flush():
        raise RuntimeError(f"put not made durable at {what}")


def get_all(store: Any, keys: Sequence[bytes], outs: Sequence[Any], batch: int, what: str) -> None:
    """Get every key in batches into `outs` (RuntimeError naming `what` on a miss)."""
    for i in range(0, len(keys), batch):
        ks = keys[i:i + batch]
        if not all(store.get_many(ks, [[o] for o in outs[:len(ks)]])):
            raise RuntimeError(f"get failed at {what}")


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


def _on_file(path: str, fn: Callable[[int], None]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        fn(fd)
    finally:
        os.close(fd)


def _each(directory: str, suffix: str, fn: Callable[[int], None]) -> None:
    for name in os.listdir(directory):
        if name.endswith(suffix):
            _on_file(os.path.join(directory, name), fn)


def _write_back_and_drop(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def drop_cache(directory: str, suffix: str) -> None:
    """Drop the page-cache pages of the files named *suffix in `directory`."""
    _each(directory, suffix, lambda fd: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED))


def drop_tree_cache(root: str) -> int:
    """Write back, then drop from the page cache, every regular file under `root` (a store's
    directory after its server stopped: the next reads come from the disk, as after a reboot or
    on another host). Returns the number of files."""
    done = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            if os.path.isfile(path) and not os.path.islink(path):
                _on_file(path, _write_back_and_drop)
                done += 1
    return done


def fsync_files(directory: str, suffix: str) -> None:
    """fsync every file named *suffix in `directory`, then the directory (its entries)."""
    _each(directory, suffix, os.fsync)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
