"""The cpu path (CPU staging, the default everywhere): pages handed to the block store from threads
kept on one NUMA node.

Primitives:
- `node_cpus(node, root)` / `numa_nodes(root)`: CPUs of a NUMA node from
  `<root>/sys/devices/system/node/nodeN/cpulist` (parsed `0-3,8-11`).
- `CpuStagingPath(store, numa_node)`: a `TransferPath`. Every batch runs on one dispatcher thread
  pinned (os.sched_setaffinity) to the node's CPUs; the store's own I/O threads are started from
  that thread, so they inherit the pinning. The store already does O_DIRECT vectored I/O with its
  bounded pool (and a bounce buffer for unaligned memory): this layer adds no copy of its own.
- GPU pages (torch CUDA tensors) cannot go to an O_DIRECT file without a host bounce: they are
  staged through two pinned host buffers, double-buffered (the GPU copies chunk i+1 while the
  store writes chunk i), see `_GpuStager`.
On a machine with one NUMA node (or an unknown node) nothing is pinned.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from offload.store.base import BlockStore, Buffer, StoreStats, never_raises, promote
from offload.transfer.base import StoreBookkeeping

log = logging.getLogger(__name__)


def parse_cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_nodes(root: str = "/") -> list[int]:
    base = os.path.join(root, "sys/devices/system/node")
    try:
        names = os.listdir(base)
    except OSError:
        return []
    return sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit())


def node_cpus(node: int, root: str = "/") -> set[int]:
    path = os.path.join(root, f"sys/devices/system/node/node{node}/cpulist")
    try:
        with open(path) as f:
            return parse_cpulist(f.read())
    except (OSError, ValueError):
        return set()


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


class CpuStagingPath(StoreBookkeeping):
    name = "cpu"

    def __init__(self, store: BlockStore, numa_node: int | None = None, *, root: str = "/"):
        self.store = store
        self.numa_node = numa_node
        self.cpus = pinning_for(numa_node, root)
        init: Callable[[], None] | None = None
        if self.cpus is not None:
            cpus = self.cpus
            init = lambda: os.sched_setaffinity(0, cpus)  # noqa: E731 - this thread only
        self._dispatch = ThreadPoolExecutor(1, thread_name_prefix="offload-cpu-path",
                                            initializer=init)
        self._stager: _GpuStager | None = None
        self._lock = threading.Lock()

    @classmethod
    def open(cls, cfg: Any, decision: Any = None, store: BlockStore | None = None
             ) -> "CpuStagingPath":
        if store is None:
            from offload.store.factory import open_disk

            store = open_disk(cfg.store)
        node = cfg.transfer.numa_node
        if node is None and decision is not None:
            node = getattr(decision, "numa_node", None)
        return cls(store, node)

    @never_raises("cpu path: a batch on the dispatcher thread", _all_false_of_keys)
    def _run(self, fn: Callable[..., list[bool]], *args: Any) -> list[bool]:
        return self._dispatch.submit(fn, *args).result()

    def register_region(self, buffer: Any) -> None:
        """Nothing to register: the store reads and writes host memory directly."""

    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]) -> list[bool]:
        if _any_gpu(blocks):
            return self._gpu().put(keys, blocks)
        return self._run(self.store.put_many, keys, blocks)

    def promote_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]
                     ) -> list[bool]:
        """A put on a read's path (a tiered store's promotion): the store's own
        (`offload.store.base.promote`), on the dispatcher thread."""
        if _any_gpu(blocks):
            return self._gpu().put(keys, blocks)
        return self._run(functools.partial(promote, self.store), keys, blocks)

    def get_many(self, keys: Sequence[bytes], dests: Sequence[Sequence[Buffer]]) -> list[bool]:
        if _any_gpu(dests):
            return self._gpu().get(keys, dests)
        return self._run(self.store.get_many, keys, dests)

    def _gpu(self) -> "_GpuStager":
        with self._lock:
            if self._stager is None:
                self._stager = _GpuStager(self)
            return self._stager

    def stats(self) -> StoreStats:
        s = self.store.stats()
        s.extra = dict(s.extra, path="cpu", numa_node=self.numa_node,
                       pinned_cpus=len(self.cpus) if self.cpus else 0)
        return s

    def tier_stats(self) -> dict[str, StoreStats]:
        return self.store.tier_stats()

    def close(self) -> None:
        self._dispatch.shutdown(wait=True)
        self.store.close()


def _any_gpu(blocks: Sequence[Sequence[Any]]) -> bool:
    return any(getattr(b, "is_cuda", False) for bs in blocks for b in bs)


class _GpuStager:
    """GPU pages <-> store through two pinned host buffers (double buffering)."""

    CHUNK = 64 << 20

    def __init__(self, path: CpuStagingPath):
        import torch

        self.torch = torch
        self.path = path
        self.bufs = [torch.empty(self.CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.stream = torch.cuda.Stream()

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

    def put(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Any]]) -> list[bool]:
        torch = self.torch
        sizes = [sum(b.numel() * b.element_size() for b in bs) for bs in blocks]
        ok = [False] * len(keys)
        pending = None
        for g, group in enumerate(self._groups(sizes)):
            if sizes[group[0]] > self.CHUNK:
                continue
            buf, off, views, event = self.bufs[g % 2], 0, [], torch.cuda.Event()
            with torch.cuda.stream(self.stream):
                for i in group:
                    for b in blocks[i]:
                        n = b.numel() * b.element_size()
                        buf[off:off + n].copy_(self._flat(b), non_blocking=True)
                        off += n
                    views.append([memoryview(buf[off - sizes[i]:off].numpy())])  # type: ignore[arg-type]
                event.record(self.stream)
            if pending is not None:   # the store writes chunk g-1 while the GPU copies chunk g
                self._store(pending, keys, ok)
            pending = (group, views, event)
        if pending is not None:
            self._store(pending, keys, ok)
        return ok

    def _store(self, pending: tuple, keys: Sequence[bytes], ok: list[bool]) -> None:
        group, views, event = pending
        event.synchronize()
        flags = self.path._run(self.path.store.put_many, [keys[i] for i in group], views)
        for i, f in zip(group, flags):
            ok[i] = f

    def get(self, keys: Sequence[bytes], dests: Sequence[Sequence[Any]]) -> list[bool]:
        torch = self.torch
        sizes = [sum(b.numel() * b.element_size() for b in bs) for bs in dests]
        ok = [False] * len(keys)
        events: list[Any] = [None, None]
        for g, group in enumerate(self._groups(sizes)):
            if sizes[group[0]] > self.CHUNK:
                continue
            buf = self.bufs[g % 2]
            if events[g % 2] is not None:     # this buffer's previous upload must be done
                events[g % 2].synchronize()
            views, off = [], 0
            for i in group:
                # an ndarray has the buffer protocol (numpy's stubs do not say so)
                views.append([memoryview(buf[off:off + sizes[i]].numpy())])  # type: ignore[arg-type]
                off += sizes[i]
            flags = self.path._run(self.path.store.get_many, [keys[i] for i in group], views)
            with torch.cuda.stream(self.stream):
                off = 0
                for i, f in zip(group, flags):
                    start = off
                    for b in dests[i]:
                        n = b.numel() * b.element_size()
                        if f:
                            self._flat(b).copy_(buf[start:start + n], non_blocking=True)
                        start += n
                    off += sizes[i]
                    ok[i] = f
                events[g % 2] = torch.cuda.Event()
                events[g % 2].record(self.stream)
        for e in events:
            if e is not None:
                e.synchronize()
        return ok
