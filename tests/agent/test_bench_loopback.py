"""`bench paths`: the dpu path's NIXL loopback baseline runs a call at a time beside each call of
the path (same bytes), so a shared machine's load weighs on both alike."""

from __future__ import annotations

import mmap
import os

import pytest

from offload.bench.paths import Loopback, measure
from offload.store.memory.store import MemoryStore
from tests.agent.conftest import needs_nixl

pytestmark = pytest.mark.slow

SIZE, BATCH = 64 << 10, 2


class CountingStore(MemoryStore):
    def __init__(self, log: list[str]):
        super().__init__(capacity=8 << 20)
        self.log = log

    def put_many(self, keys, blocks):  # type: ignore[no-untyped-def]
        self.log.append("put")
        return super().put_many(keys, blocks)

    def get_many(self, keys, dests):  # type: ignore[no-untyped-def]
        self.log.append("get")
        return super().get_many(keys, dests)


class Beside:
    """Records the baseline calls between the path's, forwarding to the real loopback."""

    def __init__(self, loopback: Loopback, log: list[str]):
        self.loopback, self.log = loopback, log

    def round(self, op: str) -> float:
        self.log.append("base-" + op)
        return self.loopback.round(op)


@needs_nixl
def test_loopback_baseline_alternates_with_each_timed_call() -> None:
    buf_map = mmap.mmap(-1, SIZE * BATCH)
    buf_map.write(os.urandom(SIZE * BATCH))
    buf = memoryview(buf_map)
    log: list[str] = []
    store = CountingStore(log)
    loopback = Loopback(buf, SIZE, BATCH)
    try:
        out = measure(store, SIZE, 3 * SIZE * BATCH, BATCH, buf, b"t",
                      Beside(loopback, log))     # type: ignore[arg-type]
    finally:
        loopback.close()
        store.close()
    assert out["failed_calls"] == 0
    assert out["beside"]["put_gbps"] > 0 and out["beside"]["get_gbps"] > 0
    timed = log[2:]              # after the warm-up's put and get
    assert timed == ["base-put", "put"] * 3 + ["base-get", "get"] * 3, log
