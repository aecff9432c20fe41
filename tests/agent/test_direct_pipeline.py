"""The zero-copy moves' pipeline: the DRAM tier's checksums run on the mover's pool while the
session's thread moves other chunks, and a block is posted to NIXL only once verified.

NIXL is replaced here by a recording agent that copies the bytes itself when a transfer is posted
(as UCX over TCP does in the posting thread), so the order of posts, waits and checksums can be
read back; the real NIXL paths are covered by test_direct.py and test_agent.py.
"""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from offload.agent import direct
from offload.agent.direct import Direct, direct_get, direct_put
from offload.agent.mover import Arena
from offload.agent.protocol import Blocks
from offload.agent.quarantine import Quarantine
from offload.store.memory.store import MemoryStore

BLOCK = 1 << 20
N = 8


class CopyingAgent:
    """The NIXL agent calls the moves make, copying at `transfer` and logging every event."""

    def __init__(self, log: list[tuple[str, Any]]):
        self.log = log

    def get_xfer_descs(self, descs: list, mem: str) -> list:
        return list(descs)

    def initialize_xfer(self, op: str, local: list, remote: list, peer: str) -> Any:
        return [op, local, remote]

    def transfer(self, handle: list) -> str:
        op, local, remote = handle
        for (la, n, _), (ra, _, _) in zip(local, remote):
            if op == "READ":
                ctypes.memmove(la, ra, n)
            else:
                ctypes.memmove(ra, la, n)
        self.log.append(("post", remote[0][0]))     # where in host memory
        return "PROC"

    def check_xfer_state(self, handle: Any) -> str:
        self.log.append(("wait", handle[2][0][0]))
        return "DONE"

    def release_xfer_handle(self, handle: Any) -> None:
        pass


class Registrar:
    def register(self, addr: int, size: int) -> object:
        return object()

    def deregister(self, reg: object) -> None:
        pass


class RecordingStore(MemoryStore):
    """The DRAM tier, logging which thread checksums (commit) or verifies (pin) which block."""

    def __init__(self, log: list[tuple[str, Any]]):
        super().__init__(capacity=4 * N * BLOCK, reserve=2 * N * BLOCK)
        self.log = log

    def commit_slots(self, slots: Any, checksums: Any = None) -> list[bool]:
        self.log.append(("commit", threading.current_thread().name))
        return super().commit_slots(slots, checksums)

    def pin_slots(self, keys: Any) -> list:
        out = super().pin_slots(keys)
        self.log.append(("pinned", [bytes(k) for k in keys]))
        return out


def _no_count(name: str, n: int = 1) -> None:
    pass


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(direct, "CHUNK_BYTES", 2 * BLOCK)      # 4 chunks of 2 blocks
    log: list[tuple[str, Any]] = []
    store = RecordingStore(log)
    agent = CopyingAgent(log)
    region = store.arena_region()
    assert region is not None
    pool = ThreadPoolExecutor(2, thread_name_prefix="sums")
    d = Direct(store, Arena(Registrar(), *region), agent,  # type: ignore[arg-type]
               Quarantine(agent), _no_count, pool)
    host = np.random.default_rng(7).integers(0, 255, N * BLOCK, np.uint8)
    yield d, store, log, host
    pool.shutdown()
    store.close()


def _req(host: np.ndarray) -> Blocks:
    base = host.ctypes.data
    return Blocks(keys=[bytes([i]) * 32 for i in range(N)], sizes=[BLOCK] * N,
                  descs=[[(base + i * BLOCK, BLOCK)] for i in range(N)])


def test_put_checksums_on_the_pool_while_later_chunks_move(rig) -> None:
    d, store, log, host = rig
    req = _req(host)
    ok = [False] * N
    assert direct_put(d, "peer", req, list(range(N)), ok, deadline=1e18) == []
    assert ok == [True] * N
    commits = [e for e in log if e[0] == "commit"]
    assert len(commits) == 4 and all(name.startswith("sums") for _, name in commits)
    # Posts are kept `AHEAD` chunks beyond the one waited on, not all made up front.
    kinds = [k for k, _ in log if k in ("post", "wait")]
    assert kinds[:direct.AHEAD + 2] == ["post"] * (direct.AHEAD + 1) + ["wait"]
    assert kinds.count("post") == 4
    # What was stored is the host's bytes, checksummed: served back intact.
    out = bytearray(N * BLOCK)
    flags = store.get_many(req.keys, [[memoryview(out)[i * BLOCK:(i + 1) * BLOCK]]
                                      for i in range(N)])
    assert flags == [True] * N and bytes(out) == host.tobytes()
    assert store.stats().checksum_failures == 0


def test_get_posts_a_block_only_after_it_was_verified_and_never_a_bad_one(rig) -> None:
    d, store, log, host = rig
    req = _req(host)
    assert store.put_many(req.keys, [[host[i * BLOCK:(i + 1) * BLOCK]] for i in range(N)]) \
        == [True] * N
    store._blocks[req.keys[5]][10:14] = b"EVIL"     # noqa: SLF001 - a late transfer's bytes
    log.clear()
    dst = np.zeros_like(host)
    ok = [False] * N
    rest = direct_get(d, "peer", _req(dst), ok, deadline=1e18)
    assert ok == [i != 5 for i in range(N)] and rest == [5]     # a miss (staging finds none)
    assert store.stats().checksum_failures == 1
    got = dst.tobytes()
    for i in range(N):
        want = host.tobytes()[i * BLOCK:(i + 1) * BLOCK] if i != 5 else bytes(BLOCK)
        assert got[i * BLOCK:(i + 1) * BLOCK] == want, f"block {i}"
    # Every post comes after the pins (checksum verified) of all the blocks it carries.
    base = dst.ctypes.data
    pinned: set[int] = set()
    for kind, what in log:
        if kind == "pinned":
            pinned |= {k[0] for k in what}
        elif kind == "post":
            chunk = (what - base) // BLOCK // 2
            assert {2 * chunk, 2 * chunk + 1} <= pinned, "posted before its blocks were verified"
    assert store._pins == {}                       # noqa: SLF001 - every pin was released
