"""In-memory block store: the DRAM tier and the fake the tests use (with failure switches).

Lifecycle: construct with a capacity; blocks are evicted least-recently-used past it. Not shared
between processes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

from offload.keys import Namespace
from offload.store.base import Buffer, StoreStats, total_len


class MemoryStore:
    def __init__(self, capacity: int = 1 << 30):
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._stats = StoreStats(capacity=capacity)
        # Failure switches for tests: keys whose reads/writes fail.
        self.fail_reads: set[bytes] = set()
        self.fail_writes: set[bytes] = set()
        self.namespaces: dict[bytes, dict[str, object]] = {}

    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]) -> list[bool]:
        out = []
        with self._lock:
            for key, bufs in zip(keys, blocks):
                if key in self.fail_writes:
                    self._stats.put_skipped += 1
                    out.append(False)
                    continue
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    out.append(True)
                    continue
                data = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
                if len(data) > self.capacity:
                    self._stats.put_skipped += 1
                    out.append(False)
                    continue
                while self._used + len(data) > self.capacity:
                    _, old = self._blocks.popitem(last=False)
                    self._used -= len(old)
                    self._stats.evictions += 1
                self._blocks[key] = data
                self._used += len(data)
                self._stats.puts += 1
                self._stats.bytes_written += len(data)
                out.append(True)
        return out

    def get_many(self, keys: Sequence[bytes], dests: Sequence[Sequence[Buffer]]) -> list[bool]:
        out = []
        with self._lock:
            for key, bufs in zip(keys, dests):
                data = self._blocks.get(key)
                if data is None or key in self.fail_reads or total_len(bufs) != len(data):
                    self._stats.misses += 1
                    out.append(False)
                    continue
                self._blocks.move_to_end(key)
                pos = 0
                for b in bufs:
                    mv = memoryview(b).cast("B")
                    mv[:] = data[pos:pos + mv.nbytes]
                    pos += mv.nbytes
                self._stats.hits += 1
                self._stats.bytes_read += len(data)
                out.append(True)
        return out

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._blocks for k in keys]

    def delete_many(self, keys: Sequence[bytes]) -> int:
        n = 0
        with self._lock:
            for k in keys:
                data = self._blocks.pop(k, None)
                if data is not None:
                    self._used -= len(data)
                    n += 1
        return n

    def clear(self, namespace: bytes | None = None) -> int:
        with self._lock:
            keys = [k for k in self._blocks if namespace is None or k.startswith(namespace)]
        return self.delete_many(keys)

    def register_namespace(self, ns: Namespace) -> None:
        self.namespaces[ns.digest()] = ns.describe()

    def stats(self) -> StoreStats:
        with self._lock:
            s = StoreStats(**vars(self._stats))
            s.blocks, s.bytes_used = len(self._blocks), self._used
            return s

    def close(self) -> None:
        pass
