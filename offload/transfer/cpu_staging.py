"""The cpu path (CPU staging, the default everywhere): pages handed to the block store from threads
kept on one NUMA node.

Primitives:
- `pinning_for(node, root)`: the CPUs the lanes are pinned to (`offload.hw.numa` reads the
  node's CPU list).
- `CpuStagingPath(store, numa_node, write_queue_bytes=WRITE_QUEUE_BYTES, write_budget=None)`: a
  `TransferPath`.
  Batches run on two lanes, each one thread pinned (os.sched_setaffinity) to the node's CPUs:
  the read lane (gets, and promotions, which are puts on a get's path) and the write lane (puts).
  A get never waits behind a put it does not need (loads before stores). The write lane holds at
  most `write_queue_bytes` of pages, running and queued together: a put that would pass it is
  refused at once, every page not stored (counted: `stats().extra["write_lane_refused"]`), so
  SGLang's backup thread never waits behind a backlog; a put on an empty lane is always taken.
  With `write_budget` (bytes per second, `offload.transfer.write_budget`) the write lane also
  keeps write-backs to that rate (`WriteBudget`, a token bucket holding one second of it): a put
  arriving while the bucket is in debt is skipped, every page not stored (counted:
  `write_budget_skipped`), so where write-backs would take the drive from reads (a GPU host
  writing back tens of GB) they give way; a put arriving with credit is taken whole and may run
  the bucket into debt, so the average rate stays within the budget and no batch is cut.
  A get of a key whose put is still queued is a miss (the store has not seen it; never partial
  bytes: the store publishes a block only once written). The store's own I/O threads are started
  from a lane's thread, so they inherit the pinning. The store already does O_DIRECT vectored I/O
  with its bounded pool (and a bounce buffer for unaligned memory): this layer adds no copy.
- GPU pages (torch CUDA tensors) cannot go to an O_DIRECT file without a host bounce: they are
  staged through two pinned host buffers per direction, double-buffered (the GPU copies chunk
  i+1 while the store writes chunk i), see `_GpuStager`; the device calls are `DeviceOps`
  (`CudaOps`; a CPU stand-in in tests, `device_ops=`). A failed copy is a miss / not stored for
  exactly its pages, counted per kind (`failure_counts()`, `offload.transfer.base`).
On a machine with one NUMA node (or an unknown node) nothing is pinned.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol, Sequence

from offload.hw.numa import node_cpus, numa_nodes
from offload.store.base import BlockStore, Buffer, StoreStats, all_false, never_raises, promote
from offload.transfer.base import FailureCounts, StoreBookkeeping, with_failures

if TYPE_CHECKING:
    from offload.config import OffloadConfig
    from offload.hw.decide import Decision

log = logging.getLogger(__name__)


def pinning_for(node: int | None, root: str = "/") -> set[int] | None:
    """The CPU set to pin I/O to, or None when pinning would not help (one node, unknown node)."""
    if node is None or len(numa_nodes(root)) < 2:
        return None
    cpus = node_cpus(node, root) & os.sched_getaffinity(0)
    if not cpus:
        log.warning("NUMA node %s has no usable CPUs here; I/O threads are not pinned", node)
        return None
    return cpus


def _all_false_of_keys(_self: Any, _fn: Any, keys: Sequence[bytes], *_: Any) -> list[bool]:
    return [False] * len(keys)


# What the write lane may hold (running and queued puts together): two of SGLang's 64-page
# write-back batches of 2 MiB pages, or half a 128-page batch of 8 MiB ones.
WRITE_QUEUE_BYTES = 256 << 20


def _nbytes(blocks: Sequence[Sequence[Buffer]]) -> int:
    return sum(memoryview(b).nbytes for bs in blocks for b in bs)


class WriteBudget:
    """A token bucket of bytes per second, holding at most one second of credit; `clock` is
    injectable (tests). `take(n)`: whether a batch of `n` bytes goes (credit left: taken whole,
    perhaps into debt) or is skipped (in debt)."""

    def __init__(self, rate: int, clock: Callable[[], float] = time.monotonic):
        self.rate = rate
        self._clock = clock
        self._credit = float(rate)
        self._at = clock()

    def take(self, n: int) -> bool:
        now = self._clock()
        # a clock stepping back (an injected one; monotonic cannot) gives and takes nothing
        self._credit = min(float(self.rate),
                           self._credit + max(0.0, now - self._at) * self.rate)
        self._at = now
        if self._credit <= 0:
            return False
        self._credit -= n
        return True


class _Lane:
    """One pinned thread that runs one kind of batch in turn. With a `bound` (bytes), a batch that
    would take what it holds (running and queued) past it is refused, unless the lane is empty."""

    def __init__(self, name: str, init: Callable[[], None] | None, bound: int | None = None,
                 budget: WriteBudget | None = None):
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=f"offload-cpu-{name}",
                                       initializer=init)
        self.bound = bound
        self.budget = budget
        self.held = 0           # bytes of the batches running or queued (under `_lock`)
        self.refused = 0        # pages refused by the bound
        self.skipped = 0        # pages skipped by the budget
        self._lock = threading.Lock()

    def _admit(self, n: int, pages: int) -> bool:
        with self._lock:
            if self.bound is not None and self.held and self.held + n > self.bound:
                self.refused += pages
                return False
            if self.budget is not None and not self.budget.take(n):
                self.skipped += pages
                return False
            self.held += n
            return True

    def _release(self, n: int) -> None:
        with self._lock:
            self.held -= n

    def run(self, fn: Callable[..., list[bool]], keys: Sequence[bytes],
            bufs: Sequence[Sequence[Buffer]]) -> list[bool]:
        n = _nbytes(bufs) if self.bound is not None or self.budget is not None else 0
        if not self._admit(n, len(keys)):
            return [False] * len(keys)
        try:
            return self.pool.submit(fn, keys, bufs).result()
        finally:
            self._release(n)


class CpuStagingPath(StoreBookkeeping):
    name = "cpu"

    def __init__(self, store: BlockStore, numa_node: int | None = None, *, root: str = "/",
                 device_ops: "DeviceOps | None" = None,
                 write_queue_bytes: int = WRITE_QUEUE_BYTES,
                 write_budget: WriteBudget | None = None):
        self.store = store
        self.failures = FailureCounts()
        self._device_ops = device_ops
        self.numa_node = numa_node
        self.cpus = pinning_for(numa_node, root)
        init: Callable[[], None] | None = None
        if self.cpus is not None:
            cpus = self.cpus
            init = lambda: os.sched_setaffinity(0, cpus)  # noqa: E731 - this thread only
        self._reads = _Lane("read", init)
        self._writes = _Lane("write", init, write_queue_bytes, write_budget)
        self._stager: _GpuStager | None = None
        self._lock = threading.Lock()

    @classmethod
    def open(cls, cfg: OffloadConfig, decision: Decision | None = None,
             store: BlockStore | None = None) -> "CpuStagingPath":
        if store is None:
            from offload.store.factory import open_disk

            store = open_disk(cfg.store)
        node = cfg.transfer.numa_node
        if node is None and decision is not None:
            node = decision.numa_node
        rate = cfg.transfer.write_budget
        return cls(store, node, write_budget=WriteBudget(rate) if rate else None)

    @never_raises("cpu path: a batch on the read lane", _all_false_of_keys)
    def _read(self, fn: Callable[..., list[bool]], keys: Sequence[bytes],
              bufs: Sequence[Sequence[Buffer]]) -> list[bool]:
        return self._reads.run(fn, keys, bufs)

    @never_raises("cpu path: a batch on the write lane", _all_false_of_keys)
    def _write(self, fn: Callable[..., list[bool]], keys: Sequence[bytes],
               bufs: Sequence[Sequence[Buffer]]) -> list[bool]:
        return self._writes.run(fn, keys, bufs)

    def register_region(self, buffer: Any) -> None:
        """Nothing to register: the store reads and writes host memory directly."""

    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]) -> list[bool]:
        if _any_gpu(blocks):
            return self._gpu().put(keys, blocks)
        return self._write(self.store.put_many, keys, blocks)

    def promote_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]
                     ) -> list[bool]:
        """A put on a read's path (a tiered store's promotion): the store's own
        (`offload.store.base.promote`), on the read lane (never behind write-backs)."""
        if _any_gpu(blocks):
            return self._gpu().put(keys, blocks, True)
        return self._read(functools.partial(promote, self.store), keys, blocks)

    def get_many(self, keys: Sequence[bytes], dests: Sequence[Sequence[Buffer]]) -> list[bool]:
        if _any_gpu(dests):
            return self._gpu().get(keys, dests)
        return self._read(self.store.get_many, keys, dests)

    def _gpu(self) -> "_GpuStager":
        with self._lock:
            if self._stager is None:
                self._stager = _GpuStager(self, self._device_ops)
            return self._stager

    def failure_counts(self) -> dict[str, int]:
        """Pages its GPU staging copies failed, per kind (`offload.transfer.base`)."""
        return self.failures.snapshot()

    def stats(self) -> StoreStats:
        s = self.store.stats()
        s.extra = dict(s.extra, path="cpu", numa_node=self.numa_node,
                       pinned_cpus=len(self.cpus) if self.cpus else 0,
                       write_lane_refused=self._writes.refused,
                       write_budget_skipped=self._writes.skipped,
                       transfer_failures=self.failure_counts())
        return s

    def tier_stats(self) -> dict[str, StoreStats]:
        return with_failures(self.store.tier_stats(), self.failure_counts())

    def close(self) -> None:
        self._writes.pool.shutdown(wait=True)
        self._reads.pool.shutdown(wait=True)
        self.store.close()


def _any_gpu(blocks: Sequence[Sequence[Any]]) -> bool:
    return any(getattr(b, "is_cuda", False) for bs in blocks for b in bs)


class DeviceOps(Protocol):
    """What the GPU stager asks of the device: pinned host memory, streams, events and copies.
    `CudaOps` on a GPU; tests inject a CPU stand-in (and failures) through `CpuStagingPath`."""

    def pinned(self, nbytes: int) -> Any:
        """A pinned host uint8 tensor of `nbytes`."""
        ...

    def stream(self) -> Any:
        ...

    def on(self, stream: Any) -> ContextManager[Any]:
        """Copies issued inside run on `stream`."""
        ...

    def event(self, stream: Any) -> Any:
        """An event recorded on `stream` now: `.synchronize()` waits for the copies before it
        (and raises if one of them failed)."""
        ...

    def copy(self, dst: Any, src: Any) -> None:
        """Enqueue `dst.copy_(src)` (asynchronous; a failure may raise here or at the event)."""
        ...


class CudaOps:
    """`DeviceOps` of torch.cuda."""

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def pinned(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=True)

    def stream(self) -> Any:
        return self.torch.cuda.Stream()

    def on(self, stream: Any) -> ContextManager[Any]:
        # after the work already queued on the current stream (the kernels that wrote the
        # pages a put copies, or last read the pages a get overwrites)
        stream.wait_stream(self.torch.cuda.current_stream())
        return self.torch.cuda.stream(stream)

    def event(self, stream: Any) -> Any:
        e = self.torch.cuda.Event()
        e.record(stream)
        return e

    def copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src, non_blocking=True)


class _Staging:
    """One direction's two pinned buffers and stream, used by one batch at a time."""

    def __init__(self, ops: DeviceOps, chunk: int):
        self.lock = threading.Lock()
        self.bufs = [ops.pinned(chunk) for _ in range(2)]
        self.stream = ops.stream()


class _GpuStager:
    """GPU pages <-> store through pinned host buffers (double buffering).

    Puts and gets have their own pair of buffers and their own stream, each taken by one batch
    at a time (a lock per direction): a get never waits behind a put's copies, and a batch never
    stages into a buffer another batch is using. A page is True only once its copy completed
    (its event synchronized without error); a failed copy makes exactly the pages it carried a
    miss (a get) or not stored (a put), counted in `path.failures`.
    """

    CHUNK = 64 << 20

    def __init__(self, path: CpuStagingPath, ops: DeviceOps | None = None):
        import torch

        self.torch = torch
        self.path = path
        self.ops: DeviceOps = ops if ops is not None else CudaOps()
        self._dirs: dict[str, _Staging] = {}
        self._lock = threading.Lock()

    def _staging(self, direction: str) -> _Staging:
        with self._lock:
            st = self._dirs.get(direction)
            if st is None:
                st = self._dirs[direction] = _Staging(self.ops, self.CHUNK)
            return st

    def _groups(self, sizes: list[int]) -> list[list[int]]:
        groups: list[list[int]] = [[]]
        used = 0
        for i, n in enumerate(sizes):
            if groups[-1] and used + n > self.CHUNK:
                groups.append([])
                used = 0
            groups[-1].append(i)
            used += n
        return groups

    def _flat(self, t: Any) -> Any:
        return t.reshape(-1).view(self.torch.uint8)

    def _synced(self, event: Any, what: str) -> bool:
        try:
            event.synchronize()
            return True
        except Exception as e:  # noqa: BLE001 - a failed copy is a miss, never raised
            log.warning("cpu path: a %s copy failed: %s", what, e)
            return False

    @never_raises("cpu path: staging GPU pages to the store", all_false)
    def put(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Any]],
            promotion: bool = False) -> list[bool]:
        """Stage GPU pages to the store: a write-back on the write lane (its bound and budget),
        a `promotion` (a put on a get's path) on the read lane, through the store's promote."""
        st = self._staging("put")
        with st.lock:
            return self._put(st, keys, blocks, promotion)

    def _put(self, st: _Staging, keys: Sequence[bytes], blocks: Sequence[Sequence[Any]],
             promotion: bool) -> list[bool]:
        sizes = [sum(b.numel() * b.element_size() for b in bs) for bs in blocks]
        ok = [False] * len(keys)
        pending = None
        for g, group in enumerate(self._groups(sizes)):
            if sizes[group[0]] > self.CHUNK:
                continue
            buf, off, staged, views = st.bufs[g % 2], 0, [], []
            with self.ops.on(st.stream):
                for i in group:
                    start = off
                    try:
                        for b in blocks[i]:
                            n = b.numel() * b.element_size()
                            self.ops.copy(buf[off:off + n], self._flat(b))
                            off += n
                    except Exception as e:  # noqa: BLE001 - this page is not stored
                        log.warning("cpu path: a GPU-to-host copy failed: %s", e)
                        self.path.failures.add("copy_to_host")
                        off = start + sizes[i]
                        continue
                    staged.append(i)
                    views.append([memoryview(buf[start:off].numpy())])  # type: ignore[arg-type]
                event = self.ops.event(st.stream)
            if pending is not None:   # the store writes chunk g-1 while the GPU copies chunk g
                self._store(pending, keys, ok, promotion)
            pending = (staged, views, event)
        if pending is not None:
            self._store(pending, keys, ok, promotion)
        return ok

    def _store(self, pending: tuple, keys: Sequence[bytes], ok: list[bool],
               promotion: bool) -> None:
        staged, views, event = pending
        if not self._synced(event, "GPU-to-host"):
            self.path.failures.add("copy_to_host", len(staged))
            return
        if not staged:
            return
        ks = [keys[i] for i in staged]
        if promotion:
            flags = self.path._read(functools.partial(promote, self.path.store), ks, views)
        else:
            flags = self.path._write(self.path.store.put_many, ks, views)
        for i, f in zip(staged, flags):
            ok[i] = f

    @never_raises("cpu path: staging store blocks to GPU pages", all_false)
    def get(self, keys: Sequence[bytes], dests: Sequence[Sequence[Any]]) -> list[bool]:
        st = self._staging("get")
        with st.lock:
            return self._get(st, keys, dests)

    def _get(self, st: _Staging, keys: Sequence[bytes], dests: Sequence[Sequence[Any]]
             ) -> list[bool]:
        sizes = [sum(b.numel() * b.element_size() for b in bs) for bs in dests]
        ok = [False] * len(keys)
        # per buffer: the pages whose host-to-GPU copies out of it are in flight, and their event
        inflight: list[tuple[list[int], Any] | None] = [None, None]
        for g, group in enumerate(self._groups(sizes)):
            if sizes[group[0]] > self.CHUNK:
                continue
            buf = st.bufs[g % 2]
            self._land(inflight, g % 2, ok)     # this buffer's previous upload must be done
            views, off = [], 0
            for i in group:
                # an ndarray has the buffer protocol (numpy's stubs do not say so)
                views.append([memoryview(buf[off:off + sizes[i]].numpy())])  # type: ignore[arg-type]
                off += sizes[i]
            flags = self.path._read(self.path.store.get_many, [keys[i] for i in group], views)
            copied: list[int] = []
            with self.ops.on(st.stream):
                off = 0
                for i, f in zip(group, flags):
                    start = off
                    off += sizes[i]
                    if not f:
                        continue
                    try:
                        for b in dests[i]:
                            n = b.numel() * b.element_size()
                            self.ops.copy(self._flat(b), buf[start:start + n])
                            start += n
                    except Exception as e:  # noqa: BLE001 - this page is a miss
                        log.warning("cpu path: a host-to-GPU copy failed: %s", e)
                        self.path.failures.add("copy_to_device")
                        continue
                    copied.append(i)
                inflight[g % 2] = (copied, self.ops.event(st.stream))
        for k in (0, 1):
            self._land(inflight, k, ok)
        return ok

    def _land(self, inflight: list[tuple[list[int], Any] | None], k: int, ok: list[bool]) -> None:
        """Wait for buffer `k`'s uploads: their pages are loaded only if every copy completed."""
        entry, inflight[k] = inflight[k], None
        if entry is None:
            return
        pages, event = entry
        if self._synced(event, "host-to-GPU"):
            for i in pages:
                ok[i] = True
        else:
            self.path.failures.add("copy_to_device", len(pages))
