"""The agent as a separate process and AgentStore clients: bytes, transports, failures, sharing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from offload.agent.client import AgentStore
from offload.agent.conn import Refused
from tests.agent.conftest import SECRET, needs_nixl, wait_for
from tests.agent.pages import DIM, HEADS, LAYERS, NS, PAGE_TOKENS, client, host_pool, keys, page

pytestmark = pytest.mark.slow


def roundtrip(store: AgentStore, register: bool) -> None:
    src, dst = host_pool(8, 1), np.zeros((2, 8 * PAGE_TOKENS, LAYERS, HEADS, DIM), np.uint16)
    if register:
        store.register_region(src)
        store.register_region(dst)
    ks = keys(8)
    assert store.put_many(ks, [page(src, i) for i in range(8)]) == [True] * 8
    assert store.exists_many(ks + keys(1, "absent")) == [True] * 8 + [False]
    assert store.get_many(ks, [page(dst, i) for i in range(8)]) == [True] * 8
    assert np.array_equal(src, dst)


@needs_nixl
def test_ucx_pages_move_by_nixl_byte_identical(agent_factory) -> None:
    agent = agent_factory("--memory")
    store = client(agent)
    try:
        roundtrip(store, register=True)
        extra = store.stats().extra
        page_bytes = 2 * PAGE_TOKENS * LAYERS * HEADS * DIM * 2
        # The bytes went by NIXL (agent READ/WRITE), none on the control connection.
        assert extra["agent_bytes_nixl_in"] == 8 * page_bytes
        assert extra["agent_bytes_nixl_out"] == 8 * page_bytes
        assert "agent_bytes_inline_in" not in extra and "agent_bytes_inline_out" not in extra
    finally:
        store.close()


@needs_nixl
def test_unregistered_memory_travels_inline(agent_factory) -> None:
    agent = agent_factory("--memory")
    store = client(agent)
    try:
        roundtrip(store, register=False)
        assert store.stats().extra["agent_bytes_inline_in"] > 0
    finally:
        store.close()


def test_tcp_transport_roundtrip_without_nixl(agent_factory) -> None:
    agent = agent_factory("--memory", "--transport", "tcp")
    store = client(agent, transport="tcp")
    try:
        roundtrip(store, register=True)          # register_region is a no-op with tcp
        s = store.stats()
        assert s.blocks == 8 and "agent_bytes_nixl_in" not in s.extra
        store.register_namespace(NS)
        assert store.delete_many(keys(3)) == 3
        assert store.exists_many(keys(4)) == [False, False, False, True]
    finally:
        store.close()


@needs_nixl
def test_ucx_client_against_tcp_agent_falls_back(agent_factory) -> None:
    agent = agent_factory("--memory", "--transport", "tcp")
    store = client(agent)
    try:
        roundtrip(store, register=True)
        extra = store.stats().extra            # the fallback happened: bytes on the connection
        page_bytes = 2 * PAGE_TOKENS * LAYERS * HEADS * DIM * 2
        assert extra["agent_bytes_inline_in"] == 8 * page_bytes
        assert extra["agent_bytes_inline_out"] == 8 * page_bytes
        assert "agent_bytes_nixl_in" not in extra and "agent_bytes_nixl_out" not in extra
    finally:
        store.close()


def test_misses_when_no_agent_and_no_hang() -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    store = AgentStore(f"127.0.0.1:{port}", SECRET, transport="tcp", timeout_s=1)
    buf = bytearray(64)
    t0 = time.monotonic()
    assert store.put_many([b"k" * 32], [[buf]]) == [False]
    assert store.get_many([b"k" * 32], [[buf]]) == [False]
    assert store.exists_many([b"k" * 32]) == [False]
    assert store.delete_many([b"k" * 32]) == 0
    assert store.stats().extra["agent"] == "unreachable"
    assert time.monotonic() - t0 < 5


@needs_nixl
@pytest.mark.parametrize("transport", ["ucx", "tcp"])
def test_agent_killed_mid_transfer_then_back(agent_factory, transport: str) -> None:
    agent = agent_factory("--memory")
    store = client(agent, transport=transport, timeout_s=2)
    n = 32
    src = np.random.default_rng(3).integers(0, 255, size=(n, 1 << 20), dtype=np.uint8)
    dst = np.zeros_like(src)
    store.register_region(src)
    store.register_region(dst)
    ks = keys(n, "big")
    results: list[list[bool]] = []
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            results.append(store.put_many(ks, [[src[i]] for i in range(n)]))
            results.append(store.get_many(ks, [[dst[i]] for i in range(n)]))

    t = threading.Thread(target=hammer, daemon=True)
    try:
        t.start()
        assert wait_for(lambda: len(results) >= 2, 20)
        agent.kill()
        killed_at = len(results)
        # No hang: calls keep returning (as misses) while the agent is dead.
        assert wait_for(lambda: len(results) >= killed_at + 3, 15)
        assert not any(results[-1])
        stop.set()
        t.join(15)
        assert not t.is_alive()
        # The agent comes back on the same port: the client reconnects by itself.
        back = agent_factory("--memory", port=agent.port)
        assert back.port == agent.port
        assert wait_for(lambda: store.put_many(ks[:4], [[src[i]] for i in range(4)]) == [True] * 4)
        dst[:] = 0
        assert store.get_many(ks[:4], [[dst[i]] for i in range(4)]) == [True] * 4
        assert np.array_equal(src[:4], dst[:4])
    finally:
        stop.set()
        store.close()


def test_restart_keeps_blocks(agent_factory, tmp_path: Path) -> None:
    pytest.importorskip("offload.store.disk.store", reason="the disk store has not landed yet")
    store_dir = tmp_path / "store"
    agent = agent_factory("--store", str(store_dir), "--capacity", "64MiB", "--transport", "tcp")
    store = client(agent, transport="tcp")
    pool, out = host_pool(4, 9), np.zeros((2, 4 * PAGE_TOKENS, LAYERS, HEADS, DIM), np.uint16)
    try:
        assert store.put_many(keys(4), [page(pool, i) for i in range(4)]) == [True] * 4
        agent.stop()
        assert store.exists_many(keys(4)) == [False] * 4     # down: misses, not errors
        agent_factory("--store", str(store_dir), "--capacity", "64MiB", "--transport", "tcp",
                      port=agent.port)
        assert wait_for(lambda: store.exists_many(keys(4)) == [True] * 4)
        assert store.get_many(keys(4), [page(out, i) for i in range(4)]) == [True] * 4
        assert np.array_equal(pool, out)
    finally:
        store.close()


def test_an_agent_over_several_drives(agent_factory, tmp_path: Path) -> None:
    """`--store` repeated: the DPU's drives as one store (blocks spread by key), kept on restart."""
    dirs = [str(tmp_path / f"nvme{i}") for i in range(3)]
    args = [a for d in dirs for a in ("--store", d)] + ["--capacity", "96MiB", "--transport", "tcp"]
    agent = agent_factory(*args)
    store = client(agent, transport="tcp")
    n = 24
    pool, out = host_pool(n, 5), np.zeros((2, n * PAGE_TOKENS, LAYERS, HEADS, DIM), np.uint16)
    try:
        assert store.put_many(keys(n), [page(pool, i) for i in range(n)]) == [True] * n
        agent.stop()
        agent_factory(*args, port=agent.port)
        assert wait_for(lambda: store.exists_many(keys(n)) == [True] * n)
        assert store.get_many(keys(n), [page(out, i) for i in range(n)]) == [True] * n
        assert np.array_equal(pool, out)
    finally:
        store.close()
    assert all(any(p.name.endswith(".slab") for p in Path(d).rglob("*")) for d in dirs)


HOST_SCRIPT = textwrap.dedent("""
    import sys, time, numpy as np
    from offload.agent.client import AgentStore
    addr, me, other, transport = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    def data(h): return np.random.default_rng(h).integers(0, 255, size=(8, 65536), dtype=np.uint8)
    def ks(h): return [bytes([h]) * 16 + i.to_bytes(16, "big") for i in range(8)]
    s = AgentStore(addr, SECRET, transport=transport, timeout_s=5)
    mine, theirs = data(me), np.zeros((8, 65536), np.uint8)
    s.register_region(mine); s.register_region(theirs)
    assert s.put_many(ks(me), [[mine[i]] for i in range(8)]) == [True] * 8
    end = time.monotonic() + 30
    while s.exists_many(ks(other)) != [True] * 8:
        assert time.monotonic() < end, "the other host never wrote"
        time.sleep(0.05)
    assert s.get_many(ks(other), [[theirs[i]] for i in range(8)]) == [True] * 8
    assert np.array_equal(theirs, data(other)), "bytes differ"
    s.close()
    print("host", me, "ok")
""").replace("SECRET", repr(SECRET))


@needs_nixl
def test_two_hosts_share_one_agent(agent_factory) -> None:
    agent = agent_factory("--memory")
    procs = [subprocess.Popen([sys.executable, "-c", HOST_SCRIPT, agent.address, str(a), str(b),
                               "ucx"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for a, b in ((1, 2), (2, 1))]
    try:
        outs = [p.communicate(timeout=60)[0].decode() for p in procs]
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@needs_nixl
def test_descriptors_outside_registered_memory_are_refused(agent_factory) -> None:
    """A host can only make the agent touch memory that host registered itself."""
    from offload.agent import protocol

    agent = agent_factory("--memory")
    store = client(agent)
    region = np.zeros(1 << 16, np.uint8)
    outside = np.ones(1 << 16, np.uint8)
    store.register_region(region)
    try:
        assert store.exists_many([b"x" * 32]) == [False]          # connected, NIXL on
        addr = outside.ctypes.data
        with store._use() as (conn, _), pytest.raises(Refused, match="outside the memory"):
            conn.request(protocol.PUT, protocol.Blocks(keys=[b"x" * 32], sizes=[4096],
                                                       descs=[[(addr, 4096)]]))
        assert store.exists_many([b"x" * 32]) == [False]
        # The same connection keeps working for memory that is registered.
        assert store.put_many([b"y" * 32], [[region[:4096]]]) == [True]
    finally:
        store.close()


@needs_nixl
def test_concurrent_put_and_get_use_separate_connections_by_nixl(agent_factory) -> None:
    """SGLang backs up and prefetches from different threads: neither waits behind the other,
    and both connections of the host move their bytes by NIXL."""
    agent = agent_factory("--memory")
    store = client(agent)
    pool = np.random.default_rng(5).integers(0, 255, size=(16, 1 << 18), dtype=np.uint8)
    out = np.zeros_like(pool)
    store.register_region(pool)
    store.register_region(out)
    ks = keys(16, "conc")
    assert store.put_many(ks[:8], [[pool[i]] for i in range(8)]) == [True] * 8
    errors: list[str] = []
    gate = threading.Barrier(2)

    def putter() -> None:
        gate.wait()
        for _ in range(10):
            if store.put_many(ks[8:], [[pool[i]] for i in range(8, 16)]) != [True] * 8:
                errors.append("put")

    def getter() -> None:
        gate.wait()
        for _ in range(10):
            if store.get_many(ks[:8], [[out[i]] for i in range(8)]) != [True] * 8:
                errors.append("get")

    threads = [threading.Thread(target=putter), threading.Thread(target=getter)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        assert np.array_equal(out[:8], pool[:8])
        assert all(c.ch is not None for c in store._conns)       # both connections were used
        extra = store.stats().extra
        assert "agent_bytes_inline_in" not in extra and "agent_bytes_inline_out" not in extra
    finally:
        store.close()


def test_agent_cli_refuses_to_start_without_a_secret_or_store(tmp_path: Path) -> None:
    import os

    env = {k: v for k, v in os.environ.items() if k != "SGLANG_OFFLOAD_SECRET"}
    base = [sys.executable, "-m", "offload.cli", "agent", "--listen", "127.0.0.1:0",
            "--transport", "tcp"]
    r = subprocess.run(base + ["--memory"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no agent secret" in r.stderr
    env["SGLANG_OFFLOAD_SECRET"] = SECRET.decode()
    r = subprocess.run(base, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--store DIR" in r.stderr
    r = subprocess.run(base[:4] + ["--listen", "nonsense"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "HOST:PORT" in r.stderr
