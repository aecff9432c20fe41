"""Issue 27: the bytes NIXL moves are checked end to end by the checksum beside them.

The control channel is MAC'd, the bytes NIXL moves are not. Here the agent's own transfers are
made to corrupt them, as altered UCX-over-TCP traffic or a faulty NIC path would: one byte of
each WRITE's source flipped as it is posted (a GET), one byte of each READ's landing flipped
when it completes (a PUT). Before, the host reported the corrupted GET loaded and the agent
stored the corrupted PUT under a valid checksum; now the host checks what landed against the
checksum the agent sent with the reply (a miss, `host_get_mismatch`), and the agent checks what
it read against the checksum the host sent with the PUT (not stored, `checksum_mismatch_in`).
Real NIXL over UCX on loopback; the agent in this process (where its transfers can be reached).
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from offload.agent import nixl_util
from offload.agent.client import AgentStore
from offload.agent.limits import AgentLimits
from offload.agent.server import AgentServer
from offload.keys import Namespace
from offload.store.memory.store import MemoryStore
from tests.agent.conftest import SECRET, needs_nixl
from tests.store.stores import open_store

pytestmark = pytest.mark.slow

NS = Namespace(model="m", dtype="bf16", layout="page_first", page_size=16)
SIZE, N = 64 << 10, 4


class Corrupt:
    """Flip one byte of what the agent's NIXL transfers move, while `op` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.op: str | None = None
        self.hits = 0
        self._reads: dict[Any, int] = {}          # handle -> landing address
        start, wait = nixl_util.start_xfer, nixl_util.wait_xfer

        def start_xfer(agent: Any, op: str, local: Any, remote: Any, peer: str) -> Any:
            if self.op == "WRITE" == op and local:
                self._flip(local[0][0])
            handle = start(agent, op, local, remote, peer)
            if self.op == "READ" == op and local:
                self._reads[handle] = local[0][0]
            return handle

        def wait_xfer(agent: Any, handle: Any, deadline: float, on_pending: Any = None,
                      peer: str = "") -> bool:
            addr = self._reads.pop(handle, None)
            ok = wait(agent, handle, deadline, on_pending, peer)
            if ok and addr is not None:
                self._flip(addr)
            return ok

        monkeypatch.setattr(nixl_util, "start_xfer", start_xfer)
        monkeypatch.setattr(nixl_util, "wait_xfer", wait_xfer)

    def _flip(self, addr: int) -> None:
        b = (ctypes.c_ubyte * 1).from_address(addr)
        b[0] ^= 0xFF
        self.hits += 1


@pytest.fixture(params=["memory", "disk"])
def rig(request, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
        ) -> Iterator[tuple[Corrupt, AgentServer, AgentStore]]:
    monkeypatch.setenv("UCX_MODULES", "^ib")
    corrupt = Corrupt(monkeypatch)
    store = (MemoryStore(64 << 20, reserve=8 << 20) if request.param == "memory"
             else open_store(tmp_path / "store", 64 << 20))
    srv = AgentServer(store, SECRET, "127.0.0.1", 0, transport="ucx",
                      limits=AgentLimits(staging_size=4 << 20))
    srv.start()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    c = AgentStore(f"127.0.0.1:{srv.port}", SECRET, timeout_s=30, connections=1)
    c.register_namespace(NS)
    yield corrupt, srv, c
    c.close()
    srv.stop()
    t.join(5)
    store.close()


def _views(a: np.ndarray) -> list[list[memoryview]]:
    return [[memoryview(a[i * SIZE:(i + 1) * SIZE])] for i in range(N)]


def _pools(c: AgentStore) -> tuple[np.ndarray, np.ndarray]:
    """(random blocks, a zeroed destination), both registered with the host's NIXL agent."""
    src = np.frombuffer(os.urandom(N * SIZE), np.uint8).copy()
    dst = np.zeros_like(src)
    c.register_region(src)
    c.register_region(dst)
    return src, dst


def _wrong(got: list[bool], src: np.ndarray, dst: np.ndarray) -> int:
    """Blocks reported True whose bytes are not the source's."""
    return sum(f and not np.array_equal(dst[i * SIZE:(i + 1) * SIZE], src[i * SIZE:(i + 1) * SIZE])
               for i, f in enumerate(got))


@needs_nixl
def test_a_get_altered_on_the_wire_is_a_miss_on_the_host(rig) -> None:
    corrupt, srv, c = rig
    src, dst = _pools(c)
    ks = [NS.key(f"g{i}") for i in range(N)]
    assert c.put_many(ks, _views(src)) == [True] * N
    assert c.flush()
    corrupt.op = "WRITE"
    got = c.get_many(ks, _views(dst))
    corrupt.op = None
    assert corrupt.hits >= 1
    served_wrong = _wrong(got, src, dst)
    assert served_wrong == 0, f"{served_wrong} altered blocks reported loaded"
    assert not all(got) and c.stats().extra["host_get_mismatch"] >= 1


@needs_nixl
def test_a_put_altered_on_the_wire_is_never_stored(rig) -> None:
    corrupt, srv, c = rig
    src, dst = _pools(c)
    ks = [NS.key(f"p{i}") for i in range(N)]
    assert c.put_many([NS.key("warm")], [[memoryview(dst[:SIZE])]]) == [True]   # proven first
    assert srv.counters().get("blocks_direct_in", 0) + srv.counters().get("blocks_staged_in", 0)
    corrupt.op = "READ"
    put = c.put_many(ks, _views(src))
    corrupt.op = None
    assert corrupt.hits >= 1
    c.flush()
    got = c.get_many(ks, _views(dst))
    wrong = _wrong(got, src, dst)
    assert wrong == 0, f"{wrong} altered blocks stored and served"
    assert not all(put) and srv.counters().get("checksum_mismatch_in", 0) >= 1, \
        (put, sorted(srv.counters().items()))
