"""Every failed GPU-side transfer is a miss (a get) or not stored (a put) for exactly the pages it
carried, counted per kind, and never a page reported loaded with bytes that are not its own.

The GPU is the project's CPU stand-ins (tests/transfer/standin.py): kvikio's CuFile over
os.pread / os.pwrite, CUDA tensors as CPU tensors, the GPU stager's device calls on the CPU; each
failure is injected through them. Stores are real (`DiskStore` with its slab files).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from offload.metrics import StoreWatch, TierMetrics
from offload.store.disk.store import DiskStore
from offload.transfer.cpu_staging import CpuStagingPath
from tests.store.stores import open_store
from tests.transfer.standin import CpuOps, Faults, OnGpu, fake_kvikio, small_chunks

torch = pytest.importorskip("torch")

N, SIZE = 6, 3 * 4096 + 11         # pages per batch, bytes per page (not 4 KiB-aligned)


def _store(tmp_path: Path) -> DiskStore:
    return open_store(tmp_path / "s", 1 << 26)


def _pages(n: int = N, seed: int = 0) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    return [OnGpu(torch.randint(0, 255, (SIZE,), dtype=torch.uint8, generator=g))
            for _ in range(n)]


def _empty(n: int = N) -> list[Any]:
    """Destinations holding a pattern no page has (so a stale page would show)."""
    return [OnGpu(torch.full((SIZE,), 0xA5, dtype=torch.uint8)) for _ in range(n)]


def _keys(tag: str, n: int = N) -> list[bytes]:
    return [f"{tag}{i}".encode().ljust(32, b"\0") for i in range(n)]


def _loaded_wrong(flags: list[bool], src: list[Any], dst: list[Any]) -> list[int]:
    """Pages reported loaded whose bytes are not their own."""
    return [i for i, f in enumerate(flags) if f and not torch.equal(src[i].tensor, dst[i].tensor)]


def _metric(path: Any, kind: str) -> float:
    """`sglang_offload_transfer_failures_total{kind}` as the metrics watcher exports it."""
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    StoreWatch(path, TierMetrics(reg)).poll()
    return reg.get_sample_value("sglang_offload_transfer_failures_total",
                                {"path": path.name, "kind": kind}) or 0.0


def _gds(store: DiskStore, faults: Faults) -> Any:
    from offload.transfer.gds import GdsPath

    return GdsPath(store, fallback=CpuStagingPath(store, device_ops=CpuOps(faults)))


# (fault, the pages that must fail, the kind counted). Faults are per call: read / write number 2
# is the third page's transfer. After a failure the page's file moves to CPU staging, which
# serves the later pages of the batch.
READS = [
    ("refused", [0], "cufile_register"),          # the file's registration, at its first page
    ("short", [2], "gds_read"),
    ("error", [2], "gds_read"),
]


@pytest.mark.parametrize("fault,failed,kind", READS, ids=[r[0] for r in READS])
def test_a_failed_gds_read_is_a_miss_for_its_page_only(tmp_path: Path, monkeypatch, fault: str,
                                                       failed: list[int], kind: str) -> None:
    faults = fake_kvikio(monkeypatch)
    store = _store(tmp_path)
    src, keys = _pages(), _keys("r")
    writer = _gds(store, Faults())
    assert writer.put_many(keys, [[s] for s in src]) == [True] * N
    if fault == "refused":
        faults.refuse = lambda path: True
    else:
        faults.reads = {2: fault}
    path = _gds(store, faults)                       # a fresh path: files registered anew
    dst = _empty()
    flags = path.get_many(keys, [[d] for d in dst])
    try:
        assert [i for i, f in enumerate(flags) if not f] == failed
        assert _loaded_wrong(flags, src, dst) == []
        assert path.failure_counts() == {kind: len(failed)}
        assert path.stats().extra["transfer_failures"] == {kind: len(failed)}
        assert _metric(path, kind) == len(failed)
        dst = _empty()                               # the file now goes through CPU staging
        assert path.get_many(keys, [[d] for d in dst]) == [True] * N
        assert _loaded_wrong([True] * N, src, dst) == []
        assert path.failure_counts() == {kind: len(failed)}
    finally:
        path.close()


WRITES = [
    ("refused", [0], "cufile_register"),
    ("short", [3], "gds_write"),
    ("error", [3], "gds_write"),
]


@pytest.mark.parametrize("fault,failed,kind", WRITES, ids=[w[0] for w in WRITES])
def test_a_failed_gds_write_stores_nothing_for_its_page(tmp_path: Path, monkeypatch, fault: str,
                                                       failed: list[int], kind: str) -> None:
    faults = fake_kvikio(monkeypatch)
    if fault == "refused":
        faults.refuse = lambda path: True
    else:
        faults.writes = {3: fault}
    store = _store(tmp_path)
    path = _gds(store, faults)
    src, keys = _pages(), _keys("w")
    try:
        flags = path.put_many(keys, [[s] for s in src])
        assert [i for i, f in enumerate(flags) if not f] == failed
        assert path.exists_many(keys) == flags           # not stored, not even half-written
        assert path.failure_counts() == {kind: len(failed)}
        assert _metric(path, kind) == len(failed)
        dst = _empty()
        got = path.get_many(keys, [[d] for d in dst])
        assert got == flags and _loaded_wrong(got, src, dst) == []
    finally:
        path.close()


def _staging(tmp_path: Path, faults: Faults) -> CpuStagingPath:
    return CpuStagingPath(_store(tmp_path), device_ops=CpuOps(faults))


def test_a_failed_host_to_gpu_copy_is_a_miss_for_its_page(tmp_path: Path) -> None:
    faults = Faults()
    path = _staging(tmp_path, faults)
    src, keys = _pages(), _keys("h")
    try:
        assert path.put_many(keys, [[s] for s in src]) == [True] * N
        faults.copies = {faults.calls["copy"] + 4: "error"}      # the fifth page's upload
        dst = _empty()
        flags = path.get_many(keys, [[d] for d in dst])
        assert flags == [True] * 4 + [False] + [True] * (N - 5)
        assert _loaded_wrong(flags, src, dst) == []
        assert path.failure_counts() == {"copy_to_device": 1}
        assert _metric(path, "copy_to_device") == 1
    finally:
        path.close()


def test_a_failed_gpu_to_host_copy_stores_nothing_for_its_page(tmp_path: Path) -> None:
    faults = Faults(copies={1: "error"})
    path = _staging(tmp_path, faults)
    src, keys = _pages(), _keys("d")
    try:
        flags = path.put_many(keys, [[s] for s in src])
        assert flags == [True, False] + [True] * (N - 2)
        assert path.exists_many(keys) == flags
        assert path.failure_counts() == {"copy_to_host": 1}
        assert _metric(path, "copy_to_host") == 1
    finally:
        path.close()


def test_an_asynchronous_copy_failure_fails_the_pages_of_its_buffer(tmp_path: Path,
                                                                    monkeypatch) -> None:
    """A CUDA error seen when the buffer's event is synchronized: every page whose copy was in
    flight in that buffer (two per buffer here) and no other."""
    small_chunks(monkeypatch, 2 * SIZE)
    faults = Faults()
    path = _staging(tmp_path, faults)
    src, keys = _pages(), _keys("a")
    try:
        faults.events = {1: "error"}                 # the second group: pages 2 and 3
        flags = path.put_many(keys, [[s] for s in src])
        assert flags == [True, True, False, False, True, True]
        assert path.exists_many(keys) == flags
        assert path.put_many(keys, [[s] for s in src]) == [True] * N
        faults.events = {faults.calls["event"] + 2: "error"}    # the get's third: pages 4, 5
        dst = _empty()
        flags = path.get_many(keys, [[d] for d in dst])
        assert flags == [True, True, True, True, False, False]
        assert _loaded_wrong(flags, src, dst) == []
        assert path.failure_counts() == {"copy_to_host": 2, "copy_to_device": 2}
    finally:
        path.close()


def test_puts_and_gets_in_two_threads_never_mix_their_staging(tmp_path: Path,
                                                             monkeypatch) -> None:
    """The GPU stager's pinned buffers: a put and a get at once each stage in their own, so a
    get never loads bytes a put staged (each copy gives the other thread a turn)."""
    small_chunks(monkeypatch, 2 * SIZE)
    path = _staging(tmp_path, Faults(yield_copies=True))
    src, keys = _pages(seed=1), _keys("g")
    assert path.put_many(keys, [[s] for s in src]) == [True] * N
    rounds, errors = 30, []
    start = threading.Barrier(2)

    def putter() -> None:
        start.wait()
        for r in range(rounds):
            pages = _pages(seed=100 + r)
            if not all(path.put_many(_keys(f"p{r}-"), [[p] for p in pages])):
                errors.append(f"put round {r}")

    def getter() -> None:
        start.wait()
        for r in range(rounds):
            dst = _empty()
            flags = path.get_many(keys, [[d] for d in dst])
            if not all(flags) or _loaded_wrong(flags, src, dst):
                errors.append(f"get round {r}: {flags}, wrong {_loaded_wrong(flags, src, dst)}")

    threads = [threading.Thread(target=putter), threading.Thread(target=getter)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
    finally:
        path.close()


# --- the dpu path: a NIXL transfer of the agent's that ends in error --------------------------


class NixlErrors:
    """Make chosen NIXL transfers of the agent end in error: a transfer of `op` posted while
    `fail` holds its ordinal (0-based, per op) reports ERR when waited on. Records the host
    memory (remote descriptors) of each failed transfer."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        from offload.agent import nixl_util

        self.fail: dict[str, set[int]] = {}
        self.posted: dict[str, int] = {}
        self.failed: list[tuple[str, list[tuple[int, int]]]] = []
        self._doomed: set[int] = set()
        self._lock = threading.Lock()
        start, state = nixl_util.start_xfer, nixl_util.xfer_state

        def start_xfer(agent: Any, op: str, local: Any, remote: Any, peer: str) -> Any:
            handle = start(agent, op, local, remote, peer)
            with self._lock:
                n = self.posted.get(op, 0)
                self.posted[op] = n + 1
                if n in self.fail.get(op, set()):
                    self._doomed.add(id(handle))
                    self.failed.append((op, list(remote)))
            return handle

        def xfer_state(agent: Any, handle: Any) -> str:
            with self._lock:
                doomed = id(handle) in self._doomed
            if doomed:
                while state(agent, handle) == "PROC":     # let UCX finish with the memory first
                    time.sleep(0.001)
                return "ERR"
            return state(agent, handle)

        monkeypatch.setattr(nixl_util, "start_xfer", start_xfer)
        monkeypatch.setattr(nixl_util, "xfer_state", xfer_state)

    def arm(self, op: str, *ordinals: int) -> None:
        with self._lock:
            base = self.posted.get(op, 0)
            self.fail[op] = {base + k for k in ordinals}
            self.failed.clear()


@pytest.fixture(params=["memory", "disk"], ids=["direct", "staged"])
def agent_rig(request, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An agent in this process (its NIXL calls can be reached) and a host client, loopback."""
    pytest.importorskip("nixl")
    from offload.agent.client import AgentStore
    from offload.agent.limits import AgentLimits
    from offload.agent.server import AgentServer
    from offload.keys import Namespace
    from offload.store.memory.store import MemoryStore
    from tests.agent.conftest import SECRET

    monkeypatch.setenv("UCX_MODULES", "^ib")
    errors = NixlErrors(monkeypatch)
    store = (MemoryStore(256 << 20, reserve=8 << 20) if request.param == "memory"
             else open_store(tmp_path / "store", 256 << 20))
    srv = AgentServer(store, SECRET, "127.0.0.1", 0, transport="ucx",
                      limits=AgentLimits(staging_size=4 << 20))
    srv.start()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    c = AgentStore(f"127.0.0.1:{srv.port}", SECRET, timeout_s=60, connections=1)
    ns = Namespace(model="m", dtype="bf16", layout="page_first", page_size=16)
    c.register_namespace(ns)
    yield errors, c, ns
    c.close()
    srv.stop()
    t.join(5)
    store.close()


PAGE = 1 << 20       # 1 MiB pages: a get moves several transfers' worth on either agent path


def _host_pages(c: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    src = np.frombuffer(os.urandom(n * PAGE), np.uint8).copy()
    dst = np.full_like(src, 0xA5)
    c.register_region(src)
    c.register_region(dst)
    return src, dst


def _in(descs: list[tuple[int, int]], base: int, n: int) -> set[int]:
    """Pages of the array at `base` that the descriptors touch."""
    return {i for a, ln in descs for i in range(n)
            if a < base + (i + 1) * PAGE and base + i * PAGE < a + ln}


def test_a_nixl_transfer_ending_in_error_is_a_miss_for_its_pages(agent_rig) -> None:
    errors, c, ns = agent_rig
    n = 12
    src, dst = _host_pages(c, n)
    keys = [ns.key(f"n{i}") for i in range(n)]
    views = [[memoryview(src[i * PAGE:(i + 1) * PAGE])] for i in range(n)]
    assert c.put_many(keys, views) == [True] * n and c.flush()
    errors.arm("WRITE", 1)                         # the get's second transfer to the host
    flags = c.get_many(keys, [[memoryview(dst[i * PAGE:(i + 1) * PAGE])] for i in range(n)])
    assert len(errors.failed) == 1, errors.failed
    # A GET's WRITEs land in the client's landing area, never in `dst` (issue 36): the failed
    # transfer's blocks are those its descriptors cover there, each a miss, the rest loaded.
    descs = errors.failed[0][1]
    land = c._landing
    assert land is not None and not _in(descs, dst.ctypes.data, n)
    assert all(land.base <= a and a + ln <= land.base + land.size for a, ln in descs)
    covered = sum(ln for _a, ln in descs)
    assert covered and covered % PAGE == 0
    missed = [i for i, f in enumerate(flags) if not f]
    assert len(missed) == covered // PAGE, (missed, covered)
    assert c.stats().extra["agent_blocks_nixl_failed"] == len(missed)     # counted by the agent
    wrong = [i for i, f in enumerate(flags)
             if f and not np.array_equal(dst[i * PAGE:(i + 1) * PAGE], src[i * PAGE:(i + 1) * PAGE])]
    assert wrong == []
    errors.arm("WRITE")                            # nothing fails: every page loads again
    dst[:] = 0xA5
    assert c.get_many(keys, [[memoryview(dst[i * PAGE:(i + 1) * PAGE])] for i in range(n)]
                      ) == [True] * n
    assert np.array_equal(dst, src)


def test_a_nixl_read_ending_in_error_stores_none_of_its_pages(agent_rig) -> None:
    errors, c, ns = agent_rig
    n = 12
    src, dst = _host_pages(c, n)
    keys = [ns.key(f"m{i}") for i in range(n)]
    assert c.put_many([ns.key("warm")], [[memoryview(dst[:PAGE])]]) == [True]   # peer proven
    errors.arm("READ", 1)                          # the put's second transfer from the host
    flags = c.put_many(keys, [[memoryview(src[i * PAGE:(i + 1) * PAGE])] for i in range(n)])
    assert len(errors.failed) == 1, errors.failed
    failed = _in(errors.failed[0][1], src.ctypes.data, n)
    assert failed and not any(flags[i] for i in failed)
    assert c.stats().extra["agent_blocks_nixl_failed"] == len(failed)
    c.flush()
    dst[:] = 0xA5
    got = c.get_many(keys, [[memoryview(dst[i * PAGE:(i + 1) * PAGE])] for i in range(n)])
    assert not any(got[i] for i in failed)
    wrong = [i for i, f in enumerate(got)
             if f and not np.array_equal(dst[i * PAGE:(i + 1) * PAGE], src[i * PAGE:(i + 1) * PAGE])]
    assert wrong == []


def test_staging_memory_that_cannot_be_had_is_a_miss_never_an_exception(tmp_path: Path) -> None:
    class NoPinned(CpuOps):
        def pinned(self, nbytes: int) -> Any:
            raise RuntimeError("CUDA error: out of memory (pinned host allocation)")

    path = CpuStagingPath(_store(tmp_path), device_ops=NoPinned())
    src, keys = _pages(2), _keys("o", 2)
    try:
        assert path.put_many(keys, [[s] for s in src]) == [False, False]
        assert path.get_many(keys, [[d] for d in _empty(2)]) == [False, False]
    finally:
        path.close()
