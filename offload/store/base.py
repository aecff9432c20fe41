"""The block-store interface every tier implements, and the data-path guard.

Keys are 32-byte `offload.keys.BlockKey` values. Blocks are written from, and read into, lists of
buffers (vectored: a block need not be contiguous in memory, e.g. one slice per layer). The data path
never raises: every batch call returns one success flag per key, and a failed or corrupt read is a
miss. Control-path problems (a directory that cannot be opened) raise `StoreError` at construction.

`never_raises(what, miss)` is the one way a data-path method keeps that promise: an exception
becomes `miss(*args)` (e.g. all False), logged with its traceback the first time at each site and
then counted, with a summary line at most once a minute.
"""

from __future__ import annotations

import functools
import logging
import mmap
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, TypeVar, Union

from offload.keys import Namespace

# Anything exposing the buffer protocol as contiguous bytes: bytes, bytearray, memoryview, numpy.
Buffer = Union[bytes, bytearray, memoryview, mmap.mmap]


@dataclass
class StoreStats:
    blocks: int = 0
    bytes_used: int = 0           # bytes the cap counts (slots allocated, committed or in flight)
    capacity: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_skipped: int = 0          # not stored: full, disk error, in flight elsewhere
    checksum_failures: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    extra: dict[str, object] = field(default_factory=dict)


class BlockStore(Protocol):
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]) -> list[bool]:
        """Store blocks; a key already stored is a success without a write.

        Args:
            keys: 32-byte block keys.
            blocks: for each key, the buffers whose concatenation is the block.
        Returns:
            One flag per key: True if the block is now stored (durably, for persistent tiers).
        """
        ...

    def get_many(self, keys: Sequence[bytes], dests: Sequence[Sequence[Buffer]]) -> list[bool]:
        """Read blocks into caller buffers (writable; their total size must equal the block's).

        Returns:
            One flag per key: True only if the bytes were read and verified.
        """
        ...

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each block is stored (a hint: a later get may still miss)."""
        ...

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delete blocks; returns how many were stored."""
        ...

    def clear(self, namespace: bytes | None = None) -> int:
        """Delete every block, or every block of one 16-byte namespace digest; returns how many
        (as far as the tier can count them)."""
        ...

    def register_namespace(self, ns: Namespace) -> None:
        """Record what a namespace digest stands for (shown by `cache stats`)."""
        ...

    def stats(self) -> StoreStats:
        ...

    def close(self) -> None:
        ...


def leading_hits(store: BlockStore, keys: Sequence[bytes]) -> int:
    """Length of the leading run of keys present (SGLang's `batch_exists` contract)."""
    n = 0
    for present in store.exists_many(keys):
        if not present:
            break
        n += 1
    return n


def total_len(buffers: Sequence[Buffer]) -> int:
    return sum(memoryview(b).nbytes for b in buffers)


def get_bytes(store: BlockStore, key: bytes, size: int) -> bytes | None:
    """Convenience read of one block of known size into new bytes (tests, tools)."""
    buf = bytearray(size)
    return bytes(buf) if store.get_many([key], [[buf]])[0] else None


F = TypeVar("F", bound=Callable[..., Any])
SUMMARY_EVERY_S = 60.0


class _Site:
    """Failures of one guarded call site: the first is logged in full, later ones counted."""

    def __init__(self, logger: logging.Logger, what: str):
        self.logger, self.what = logger, what
        self.lock = threading.Lock()
        self.failures = 0
        self.unreported = 0
        self.reported_at = 0.0

    def failed(self, e: BaseException) -> None:
        with self.lock:
            self.failures += 1
            first = self.failures == 1
            now = time.monotonic()
            self.unreported += 0 if first else 1
            summary = not first and now - self.reported_at >= SUMMARY_EVERY_S
            if first or summary:
                self.reported_at = now
            n, self.unreported = (self.unreported, 0) if summary else (0, self.unreported)
        if first:
            self.logger.error("%s failed; reporting a miss (further failures here are counted)",
                              self.what, exc_info=e)
        elif summary:
            self.logger.warning("%s failed %d more times (last: %s: %s); reporting misses",
                                self.what, n, type(e).__name__, e)
        else:
            self.logger.debug("%s failed: %s: %s", self.what, type(e).__name__, e)


def never_raises(what: str, miss: Callable[..., Any], logger: logging.Logger | None = None
                 ) -> Callable[[F], F]:
    """Decorate a data-path function: any exception returns `miss(*args, **kwargs)` instead.

    Args:
        what: names the operation in the log ("batch_get_v1").
        miss: builds the miss from the call's own arguments (`lambda self, keys, *_: [False] *
            len(keys)`); it must not raise.
        logger: where failures go (default: the decorated function's module logger).
    """
    def wrap(fn: F) -> F:
        site = _Site(logger or logging.getLogger(fn.__module__), what)

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - the data path turns every failure into a miss
                site.failed(e)
                return miss(*args, **kwargs)

        guarded.failures = site  # type: ignore[attr-defined]  # tests read the count
        return guarded  # type: ignore[return-value]

    return wrap


def all_false(_self: Any, keys: Sequence[Any], *_: Any, **__: Any) -> list[bool]:
    """The miss of a batch call over `keys`: one False per key."""
    return [False] * len(keys)
