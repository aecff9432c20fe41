"""The block-store interface every tier implements, zero-copy slot access, and the data-path guard.

Keys are 32-byte `offload.keys.BlockKey` values. Blocks are written from, and read into, lists of
buffers (vectored: a block need not be contiguous in memory, e.g. one slice per layer). The data path
never raises: every batch call returns one success flag per key, and a failed or corrupt read is a
miss. Control-path problems (a directory that cannot be opened) raise `StoreError` at construction.
`tier_stats()` gives a store's statistics per tier (`local`, `redis`, `agent`: the metric labels).

`SlotStore` is what a store offers a mover that reads or writes a block's bytes itself (the agent's
NIXL transfers into the DRAM tier, GDS DMA into slab files): `reserve_slots` -> the mover writes
each `Slot` -> `commit_slots` (visible) or `abort_slots` (freed); `pin_slots` -> the mover reads
-> `unpin_slots`. A `Slot` is memory (`view`) or a byte range of a file (`path`, `offset`), as
the store's `slot_medium` says.

A put's True means "written, and stored unless its commit fails" for a store that commits in the
background (the disk store); `durable(store, keys, ok)` narrows such flags to what is durable now
(a server's acknowledgement to its client). A store that writes some puts later says what waits
(`HasBacklog.backlog()`: per tier, `Backlog(pages, bytes)`).

What a store can do beyond `BlockStore` is declared, never probed by attribute name: each optional
ability is a `runtime_checkable` Protocol here (`SlotStore`, `Durable`, `Promotable`, `Flushable`,
`HasBacklog`, `RegistersRegions`, `CommitsNow`), asked with `isinstance`. A store made of other
stores (a tiered store, a transfer path over its block store, a spread store over its drives) is a
`Composite`: `parts()` names its inner stores, as zarr's wrapper stores do. `walk(store)` is the one
way through that graph (the store, then its parts, breadth first, each once) and `find(store, P)`
the stores on it that implement `P` (events find the disk stores under a path, the agent's acks a
store's `Durable`).

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
from typing import (
    Any,
    Callable,
    Literal,
    NamedTuple,
    Protocol,
    Sequence,
    TypeVar,
    Union,
    cast,
    runtime_checkable,
)

from offload.keys import Namespace

# Anything exposing the buffer protocol as contiguous bytes: bytes, bytearray, memoryview, numpy.
Buffer = Union[bytes, bytearray, memoryview, mmap.mmap]


@dataclass
class StoreStats:
    blocks: int = 0
    bytes_used: int = 0           # bytes of the blocks stored (slots of committed blocks)
    capacity: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_skipped: int = 0          # not stored: full, disk error, in flight elsewhere
    checksum_failures: int = 0    # blocks proven bad on disk (dropped)
    reused_reads: int = 0         # reads that met a slot deleted or reused meanwhile (misses)
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    damaged_rows: int = 0         # index rows that failed the range checks (a miss each, dropped)
    index_busy: int = 0           # data-path index waits past their deadline (a miss / a skip)
    bytes_reserved: int = 0       # slots held ahead for this process's puts (not in bytes_used)
    extra: dict[str, object] = field(default_factory=dict)


@runtime_checkable
class BlockStore(Protocol):
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]) -> list[bool]:
        """Store blocks; a key already stored is a success without a write.

        Args:
            keys: 32-byte block keys.
            blocks: for each key, the buffers whose concatenation is the block.
        Returns:
            One flag per key: True if the block is now stored (a persistent tier may make it
            durable and visible to other processes in the background: see `durable`).
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

    def tier_stats(self) -> dict[str, StoreStats]:
        """Statistics per tier, keyed by the tier's metric label (`local`, `redis`, `agent`): one
        entry for a single store, one per part for a tiered one. `extra["process_counters"]`
        names the counters that are this process's own when not all are (a shared agent's)."""
        ...

    def close(self) -> None:
        ...


SlotMedium = Literal["memory", "file"]


@dataclass(frozen=True, eq=False)
class Slot:
    """Where one block's bytes are, for a mover that moves them itself.

    Memory slots carry `view` (the block's bytes); file slots carry `path` and `offset` (where the
    block's data starts, 4 KiB aligned) and, when pinned, the stored `checksum` (WSUM64)."""
    key: bytes
    length: int
    view: memoryview | None = None
    path: str = ""
    offset: int = 0
    checksum: int = 0


@runtime_checkable
class SlotStore(BlockStore, Protocol):
    """Zero-copy access to a store's slots. Never raises: a failure is None / False per key."""

    slot_medium: SlotMedium

    def reserve_slots(self, keys: Sequence[bytes], sizes: Sequence[int]) -> list[Slot | None]:
        """Slots for new blocks, counted against the cap and invisible until committed.

        Returns:
            One slot per key; None where the key is stored or being written already, or does
            not fit (put_many is the way for those).
        """
        ...

    def commit_slots(self, slots: Sequence[Slot], checksums: Sequence[int] | None = None
                     ) -> list[bool]:
        """Make written slots visible (durable first, for files).

        Args:
            slots: reserved slots whose bytes the mover wrote.
            checksums: the WSUM64 of each slot's bytes as the mover computed it (file slots
                store it; without it the store computes it from the file); memory ignores it.
        Returns:
            One flag per slot: True if the block is now stored.
        """
        ...

    def abort_slots(self, slots: Sequence[Slot]) -> None:
        """Free reserved slots whose write failed or was not attempted."""
        ...

    def pin_slots(self, keys: Sequence[bytes]) -> list[Slot | None]:
        """Stored blocks' slots to read from (None on a miss). Memory keeps a pinned slot from
        eviction and reuse until `unpin_slots`; a file slot is not held (a block evicted meanwhile
        fails its checksum: a miss)."""
        ...

    def unpin_slots(self, slots: Sequence[Slot], ok: Sequence[bool] | None = None) -> None:
        """End `pin_slots`; `ok` (per slot, default all) counts the reads that reached their
        reader as hits."""
        ...

    def arena_region(self) -> tuple[int, int] | None:
        """(address, length) of the one memory region every memory slot lies in (registered
        once with NIXL by the agent); None without one (files, or scattered memory)."""
        ...


def leading(flags: Sequence[bool]) -> int:
    """Length of the leading run of True (SGLang's `batch_exists` contract)."""
    return next((i for i, f in enumerate(flags) if not f), len(flags))


@runtime_checkable
class Durable(Protocol):
    """A store that makes puts durable in the background (`DiskStore`'s group commit, the agent
    client): `durable(keys)` waits for this process's puts of `keys` and says which are durable."""

    def durable(self, keys: Sequence[bytes]) -> list[bool]:
        ...


@runtime_checkable
class Promotable(Protocol):
    """A store with a put for a read's path (`promote_many`: a tiered store copying a block the
    shared tier served into the local one): it waits for its index no longer than a read does."""

    def promote_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]
                     ) -> list[bool]:
        ...


@runtime_checkable
class Flushable(Protocol):
    """A store whose puts become durable after they return: `flush()` waits for all of them and
    is False if one was lost since the last flush."""

    def flush(self) -> bool:
        ...


class Backlog(NamedTuple):
    """Pages a store accepted for a tier and has not written to it yet, and their bytes."""
    pages: int
    bytes: int


@runtime_checkable
class HasBacklog(Protocol):
    """A store that writes some of its puts later (the tiered store's uploads to the shared
    tier): `backlog()` is what waits, per tier name (those of `tier_stats()`)."""

    def backlog(self) -> dict[str, Backlog]:
        ...


@runtime_checkable
class RegistersRegions(Protocol):
    """A store (or mover) that registers the memory pages move through (NIXL on the dpu path)."""

    def register_region(self, buffer: Any) -> None:
        ...


@runtime_checkable
class CommitsNow(Protocol):
    """A store that groups its background commits (`DiskStore`'s group commit) and can be told to
    commit what is pending at once (a waiter that cannot wait for the next round)."""

    def commit_now(self) -> None:
        ...


@runtime_checkable
class Composite(Protocol):
    """A store made of other stores (zarr's wrapper stores are the model): a tiered store (its
    local and shared tiers), a transfer path (the block store it moves bytes for), a spread store
    (each drive's store in service). `parts()` are the inner stores, in the composite's order;
    `walk` and `find` below are the way through them."""

    def parts(self) -> Sequence[BlockStore]:
        ...


Cap = TypeVar("Cap")


def walk(store: object) -> list[object]:
    """`store` and every store it is made of (`Composite.parts`, recursively): breadth first, the
    outermost first, each store once however often it is reached."""
    out: list[object] = []
    todo: list[object] = [store]
    while todo:
        s = todo.pop(0)
        if any(s is o for o in out):
            continue
        out.append(s)
        if isinstance(s, Composite):
            todo += list(s.parts())
    return out


def find(store: object, capability: Callable[..., Cap]) -> list[Cap]:
    """The stores of `walk(store)` that are instances of `capability` (a class, or a
    `runtime_checkable` Protocol such as `Durable`), outermost first.

    `capability` is typed as a callable because mypy accepts no Protocol for `type[Cap]`; a
    Protocol that is not runtime-checkable raises TypeError (a programming error, found at once)."""
    if not isinstance(capability, type):
        raise TypeError(f"find() takes a class or a runtime-checkable Protocol, not {capability!r}")
    return [cast(Cap, s) for s in walk(store) if isinstance(s, capability)]


def leading_hits(store: BlockStore, keys: Sequence[bytes]) -> int:
    """Length of the leading run of keys present (SGLang's `batch_exists` contract)."""
    return leading(store.exists_many(keys))


def durable(store: BlockStore, keys: Sequence[bytes], ok: Sequence[bool]) -> list[bool]:
    """A put's flags narrowed to the blocks that are durable now: a store that commits in the
    background (`DiskStore`'s group commit: `durable(keys)`) is waited for; any other store's put
    is as durable as that store gets when it returns."""
    if not isinstance(store, Durable):
        return list(ok)
    return [bool(o and d) for o, d in zip(ok, store.durable(keys))]


def promote(store: BlockStore, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]
            ) -> list[bool]:
    """Put blocks on a read's path: the store's `promote_many` where it has one (`Promotable`),
    else its `put_many`."""
    if isinstance(store, Promotable):
        return store.promote_many(keys, blocks)
    return store.put_many(keys, blocks)


def flush(store: BlockStore) -> bool:
    """Wait until the store's puts so far are durable (a store that commits in the background:
    its `flush()`); True unless one was lost. Any other store's puts are as durable as it gets."""
    return not isinstance(store, Flushable) or store.flush() is not False


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
