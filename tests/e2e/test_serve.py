"""The tier under a real SGLang server, started through `sglang-offload launch` on the CPU.

One server seeds a store (module fixture `seeded`: two prompts served cold on the real model,
their write-back to the store waited for); each test then works on its own copy of that store, so
tests stay independent and the seed costs one server start. Greedy decoding: the same prompt gives
the same answer whether its KV was computed or loaded, checked at the logprob (`assert_agrees`:
the same tokens, every logprob within offload.agree's measured tolerance). A "hit" is
`cached_tokens` = the prompt less its last partial page (SGLang always computes the last
token), with SGLang's breakdown naming the storage tier. Replicas sharing Redis or a storage
agent (the dpu path) and hitting each other's pages: tests/e2e/test_kv_events.py, whose two
replicas also check their events.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from offload.launch.server import LaunchedServer, Reply, wait_store
from tests.e2e.conftest import (
    PAGE,
    assert_agrees,
    full_pages,
    needs_serving,
    prompt,
    store_blocks,
    wait_metric,
)

pytestmark = needs_serving
TOKENS = 1200                       # ~19 pages: long enough to matter, short for 2 cores


@dataclass
class Seed:
    store: Path
    prompts: list[str]
    cold: list[Reply]


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory, real_model: Path) -> Seed:
    from tests.e2e.conftest import deployment, free_port

    tmp = tmp_path_factory.mktemp("seed")
    store = tmp / "store"
    port = free_port()
    cfg = deployment(tmp / "seed.yaml", real_model, port, store)
    server = LaunchedServer.start(cfg, tmp / "seed.log", f"http://127.0.0.1:{port}",
                                  env={"UCX_MODULES": "^ib"})
    try:
        server.wait_ready()
        prompts = [prompt(TOKENS, seed) for seed in (1, 2)]
        cold = [server.generate(p) for p in prompts]
        assert all(r.cached_tokens == 0 for r in cold), [r.cached_tokens for r in cold]
        pages = sum(full_pages(r.prompt_tokens) // PAGE for r in cold)
        assert wait_store(store, pages) >= pages, server.tail()
    except BaseException:
        print(server.tail(80))
        raise
    finally:
        server.stop()
    return Seed(store, prompts, cold)


def _copy(seed: Seed, tmp_path: Path) -> Path:
    out = tmp_path / "store"
    shutil.copytree(seed.store, out)
    return out


def _assert_l3_hit(r: Reply, cold: Reply, model: Path) -> None:
    assert_agrees(cold, r, "the L3 hit", model)
    assert r.cached_tokens == full_pages(cold.prompt_tokens), r
    assert r.details.get("storage", 0) > 0, r.details


def _corrupt_one_block(store: Path) -> None:
    """Flip bytes in the middle of the first slab file's data (a block of the seeded prompts)."""
    slabs = sorted(p for p in store.rglob("*") if p.is_file() and p.stat().st_size >= 1 << 20)
    assert slabs, sorted(str(p) for p in store.rglob("*"))
    with open(slabs[0], "r+b") as f:
        f.seek(4096 * 3 + 100)
        data = bytearray(f.read(64))
        f.seek(4096 * 3 + 100)
        f.write(bytes(b ^ 0xFF for b in data))


def test_a_corrupted_block_is_recomputed_and_counted(seeded: Seed, servers, tmp_path: Path,
                                                     real_model: Path) -> None:
    store = _copy(seeded, tmp_path)
    _corrupt_one_block(store)
    s = servers(store, model=real_model)
    replies = [s.generate(p) for p in seeded.prompts]
    for r, cold in zip(replies, seeded.cold):
        assert_agrees(cold, r, "recomputed past the corrupt block", real_model)
    full = sum(full_pages(c.prompt_tokens) for c in seeded.cold)
    assert sum(r.cached_tokens for r in replies) < full             # the bad block was not used
    # counted as the store saw it; the exporter thread publishes every 10 s
    assert wait_metric(s, "sglang_offload_checksum_failures_total", "", 1, timeout=60) >= 1


def test_restart_serves_from_l3_and_sigkill_mid_write_back_loses_nothing(
        seeded: Seed, servers: Callable[..., LaunchedServer], tmp_path: Path,
        real_model: Path) -> None:
    store = _copy(seeded, tmp_path)
    s = servers(store, name="restart", model=real_model)      # a restart: L1 and L2 are empty
    hit = s.generate(seeded.prompts[0])
    _assert_l3_hit(hit, seeded.cold[0], real_model)
    again = s.generate(seeded.prompts[0])                    # now from L1/L2, same answer
    assert_agrees(seeded.cold[0], again, "the L1/L2 hit", real_model)
    assert_agrees(hit, again, "the L1/L2 hit against the L3 hit before it", real_model)
    assert again.cached_tokens == full_pages(seeded.cold[0].prompt_tokens)
    before = store_blocks(store)
    long = prompt(4 * TOKENS, 3)
    cold = s.generate(long)                  # its write-back starts as the reply is sent
    s.kill()                                 # SIGKILL the whole server: no flush, no close
    s2 = servers(store, name="after-kill", model=real_model)
    r = s2.generate(long)
    assert_agrees(cold, r, "after the SIGKILL", real_model)
    assert r.cached_tokens % PAGE == 0 and r.cached_tokens <= full_pages(cold.prompt_tokens)
    _assert_l3_hit(s2.generate(seeded.prompts[1]), seeded.cold[1], real_model)   # old blocks intact
    assert store_blocks(store) >= before


def test_a_server_on_two_drives_serves_l3_after_restart(
        servers: Callable[..., LaunchedServer], tmp_path: Path, demo_model: Path) -> None:
    """`offload.store.paths`: a real server through `launch` writes a prompt's pages back over two
    directories (each holds a share) and, restarted, serves them from L3 with the same tokens."""
    drives = [tmp_path / f"nvme{i}" / "offload" for i in range(2)]
    text = prompt(4 * TOKENS, 11)
    first = servers(drives, name="drives-1")
    cold = first.generate(text)
    pages = full_pages(cold.prompt_tokens) // PAGE
    deadline = time.monotonic() + 120
    while sum(store_blocks(d) for d in drives) < pages and time.monotonic() < deadline:
        time.sleep(0.5)
    assert sum(store_blocks(d) for d in drives) >= pages, first.tail()
    assert all(store_blocks(d) > 0 for d in drives)
    first.stop()
    second = servers(drives, name="drives-2")
    _assert_l3_hit(second.generate(text), cold, demo_model)
