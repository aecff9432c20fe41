"""Every tier runs the block-store contract (tests/store/contract.py): the DRAM tier, the disk
store on real files, three directories as one spread store, the Redis tier against a real
redis-server, the tiered store (DRAM in front of Redis), the agent as a separate process
over NIXL/UCX on loopback; and what the HiCache backend actually holds, built as its
`_open_store` builds it (`make_tiered(open_path(cfg))`): the cpu staging path over a disk store,
alone and tiered over a real redis-server."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from offload.config import OffloadConfig, Size, StoreConfig, load_offload
from offload.store.base import BlockStore
from offload.store.memory.store import MemoryStore
from offload.store.redis.store import RedisStore
from offload.store.tiered import TieredStore, WriteThrough, make_tiered
from offload.transfer.cpu_staging import CpuStagingPath
from tests.agent.conftest import SECRET, AgentProc, needs_nixl
from tests.store.contract import StoreContract
from tests.store.redis_fixtures import RedisProc, redis_factory, redis_server  # noqa: F401
from tests.store.stores import open_store


class TestMemoryContract(StoreContract):
    @pytest.fixture
    def store(self) -> Iterator[BlockStore]:
        s = MemoryStore(capacity=64 << 20)
        yield s
        s.close()


class TestDiskContract(StoreContract):
    persistent = True

    def _open(self) -> BlockStore:
        return open_store(self.path, 64 << 20, o_direct="auto")

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[BlockStore]:
        self.path = tmp_path / "cache"
        s = self._open()
        yield s
        s.close()

    def reopen(self, store: BlockStore) -> BlockStore:
        store.close()
        return self._open()


class TestSpreadContract(StoreContract):
    """Three directories as one store (`offload.store.paths`)."""
    persistent = True

    def _open(self) -> BlockStore:
        from offload.store.disk.spread import SpreadStore

        dirs = tuple(str(self.path / f"drive{i}") for i in range(3))
        return SpreadStore(StoreConfig(paths=dirs, capacity=Size(96 << 20), min_free=Size(0),
                                       o_direct="auto"))

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[BlockStore]:
        self.path = tmp_path
        s = self._open()
        yield s
        s.close()

    def reopen(self, store: BlockStore) -> BlockStore:
        store.close()
        return self._open()


def _redis(url: str) -> RedisStore:
    return RedisStore(load_offload({"redis": {"url": url, "timeout_s": 5.0}}).redis)


class TestRedisContract(StoreContract):
    persistent = True                         # kept by Redis across our restarts and its own

    @pytest.fixture
    def store(self, redis_server: RedisProc) -> Iterator[BlockStore]:  # noqa: F811
        self.server = redis_server
        s = _redis(redis_server.url)
        yield s
        s.close()

    def reopen(self, store: BlockStore) -> BlockStore:
        store.close()
        self.server.kill(signal.SIGKILL)       # AOF, fsync always: a crash loses nothing
        self.server.start()
        return _redis(self.server.url)


class TestTieredContract(StoreContract):
    persistent = True                         # the DRAM tier is lost; Redis serves the blocks

    @pytest.fixture
    def store(self, redis_server: RedisProc) -> Iterator[BlockStore]:  # noqa: F811
        self.server = redis_server
        s = TieredStore(MemoryStore(capacity=64 << 20), _redis(redis_server.url), WriteThrough())
        yield s
        s.close()

    def reopen(self, store: BlockStore) -> BlockStore:
        store.close()
        return TieredStore(MemoryStore(capacity=64 << 20), _redis(self.server.url),
                           WriteThrough())


@pytest.fixture(scope="class")
def memory_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProc]:
    agent = AgentProc(tmp_path_factory.mktemp("agent"), ["--memory"]).start()
    yield agent
    agent.stop()


@needs_nixl
class TestAgentContract(StoreContract):
    """Buffers come from one registered region, so every block moves by NIXL (UCX on loopback).
    One agent serves the class; each test has its own namespace. `clear` is the agent host's
    (`sglang-offload cache clear` there), not a client's."""

    supports_clear = False

    @pytest.fixture
    def store(self, memory_agent: AgentProc) -> Iterator[BlockStore]:
        from offload.agent.client import AgentStore

        s = AgentStore(memory_agent.address, SECRET, transport="ucx", timeout_s=10,
                       reconnect_s=0.2)
        self.region = np.zeros(16 << 20, dtype=np.uint8)
        self.used = 0
        s.register_region(self.region)
        yield s
        s.close()

    def buffer(self, nbytes: int) -> Any:
        start, self.used = self.used, self.used + nbytes
        assert self.used <= self.region.nbytes, "the test region is too small"
        return memoryview(self.region[start:self.used]).cast("B")

    def test_blocks_move_by_nixl_not_inline(self, store: BlockStore) -> None:
        ks = self.put(store, ["nixl-0", "nixl-1"])
        assert store.get_many(ks, self.dests(2)) == [True, True]
        extra = store.stats().extra
        assert extra["agent_bytes_nixl_in"] >= 2 * 16 << 10
        assert extra["agent_bytes_nixl_out"] >= 2 * 16 << 10
        assert "agent_bytes_inline_in" not in extra and "agent_bytes_inline_out" not in extra


def _backend_cfg(path: Path, redis_url: str = "") -> OffloadConfig:
    """The settings the HiCache backend is given: the cpu transfer path over a disk store on
    `path`, tiered over Redis when `redis_url` is set."""
    tree: dict[str, Any] = {"store": {"path": str(path), "capacity": "64MiB", "min_free": 0,
                                      "o_direct": "auto"},
                            "transfer": {"path": "cpu"}}
    if redis_url:
        tree["redis"] = {"url": redis_url, "timeout_s": 5.0}
    return load_offload(tree)


def _backend_store(cfg: OffloadConfig) -> BlockStore:
    """What the backend holds, built as `offload.hicache.backend._open_store` builds it."""
    from offload.transfer.base import open_path

    return make_tiered(open_path(cfg), cfg.redis)


class TestCpuPathContract(StoreContract):
    """The cpu staging path over a disk store (offload/transfer/cpu_staging.py): what the backend
    holds on a machine without a GPU or a DPU and without Redis."""
    persistent = True

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[BlockStore]:
        self.cfg = _backend_cfg(tmp_path / "cache")
        s = _backend_store(self.cfg)
        assert isinstance(s, CpuStagingPath)
        yield s
        s.close()

    def reopen(self, store: BlockStore) -> BlockStore:
        store.close()
        return _backend_store(self.cfg)


class TestTieredDiskRedisContract(StoreContract):
    """The cpu staging path over a disk store, tiered over a real redis-server: what the backend
    holds with `offload.redis.url` set."""
    persistent = True                         # on the local disk and in Redis

    @pytest.fixture
    def store(self, tmp_path: Path, redis_server: RedisProc) -> Iterator[BlockStore]:  # noqa: F811
        self.cfg = _backend_cfg(tmp_path / "cache", redis_server.url)
        s = _backend_store(self.cfg)
        assert isinstance(s, TieredStore)
        yield s
        s.close()

    def reopen(self, store: BlockStore) -> BlockStore:
        store.close()
        return _backend_store(self.cfg)
