"""L3 KV events on real servers started through `sglang-offload launch`, read by a real ZMQ
subscriber decoding with SGLang's own classes (`offload.events.subscribe`).

One server lifecycle per test (servers are slow to start here): a request's pages appear as GPU
events and then as DISK events after the write-back, with the hashes SGLang computes for the
prompt; a restart on the full store announces the same hashes from L3 (through SGLang's replay
endpoint: the subscriber joins after the announcement); an eviction by another process
(`sglang-offload cache evict`) produces `BlockRemoved` DISK; two replicas sharing one Redis see
`EXTERNAL` events for each other's pages, and so do two replicas on one storage agent (the dpu
path, NIXL over UCX on loopback); in both, the second replica's first request of the first one's
prompt is then served from the tier they share with the first one's greedy tokens.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from offload.launch.server import LaunchedServer, free_port, wait_store
from tests.e2e.conftest import PAGE, assert_agrees, full_pages, needs_serving

pytestmark = [needs_serving, pytest.mark.timeout(1800)]   # two server lifecycles on 2 cores
TOKENS = 640                 # 10 pages
WAIT_S = 180.0


def kv_events(port: int) -> dict[str, str]:
    return {"kv-events-config": json.dumps({
        "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}", "bind": True,
        "replay_endpoint": f"tcp://127.0.0.1:{port + 1}", "topic": "kv"})}


def ids(seed: int, n: int = TOKENS) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(300, 760) for _ in range(n)]


class Watch:
    """One server's events: residency per medium, and the order in which hashes arrived."""

    def __init__(self, port: int, replay: bool = False):
        from offload.events.subscribe import Residency, Subscriber

        self.sub = Subscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", "kv")
        self.res = Residency()
        self.first: dict[tuple[str, int], int] = {}     # (medium, hash) -> first seq stored
        self.removed: dict[str, set[int]] = {}
        time.sleep(0.5)                                  # the SUB socket's connection
        if replay:
            self._apply(self.sub.replay(0))

    def _apply(self, batches: list) -> None:
        from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored

        for seq, batch in batches:
            for ev in batch.events:
                medium = str(getattr(ev, "medium", None) or "GPU")
                if isinstance(ev, BlockStored):
                    for h in ev.block_hashes:
                        self.first.setdefault((medium, h), seq)
                elif isinstance(ev, BlockRemoved):
                    self.removed.setdefault(medium, set()).update(ev.block_hashes)
            self.res.apply(seq, batch)

    def until(self, cond: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                held = {m: len(h) for m, h in self.res.held.items()}
                raise AssertionError(f"timed out waiting for {what}; held {held}, "
                                     f"removed {({m: len(h) for m, h in self.removed.items()})}")
            self._apply(self.sub.poll(1.0))

    def holds(self, hashes: list[int], medium: str) -> bool:
        return self.res.prefix_pages(hashes, medium) == len(hashes)


def _evict_all(store: Path) -> None:
    subprocess.run([sys.executable, "-m", "offload.cli", "cache", "evict", str(store), "--to", "0"],
                   check=True, capture_output=True, timeout=120)


def test_disk_events_follow_gpu_then_restart_announces_and_eviction_removes(
        servers: Callable[..., LaunchedServer], tmp_path: Path) -> None:
    from offload.events.subscribe import prompt_hashes

    store = tmp_path / "store"
    port = free_port()
    a = servers(store, name="events", sglang=kv_events(port))
    w = Watch(port)
    tokens = ids(1)
    hashes = prompt_hashes(tokens, PAGE)
    cold = a.generate(tokens)
    pages = full_pages(cold.prompt_tokens) // PAGE
    hashes = hashes[:pages]
    w.until(lambda: w.holds(hashes, "GPU"), "GPU events of the prompt's pages")
    w.until(lambda: w.holds(hashes, "DISK"), "DISK events after the write-back")
    for h in hashes:          # each page went to the GPU (or host) before it was on disk
        assert w.first[("GPU", h)] <= w.first[("DISK", h)]
    assert wait_store(store, pages) >= pages
    a.stop(grace=20)

    b = servers(store, name="events-restart", sglang=kv_events(port))
    late = Watch(port, replay=True)                   # joins after the start-up announcement
    late.until(lambda: late.holds(hashes, "DISK"), "the restart's DISK announcement")
    assert late.res.prefix_pages(hashes, "GPU") == 0  # nothing of it in L1 yet: L3 only
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps(tokens))
    out = subprocess.run([sys.executable, "-m", "offload.cli", "events", b.url, "--input-ids",
                          str(ids_file), "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    tiers = json.loads(out.stdout)["servers"][0]["tiers"]     # what a router would score
    assert tiers["DISK"]["tokens"] >= len(hashes) * PAGE and tiers["GPU"]["tokens"] == 0, tiers
    _evict_all(store)                                  # another process empties the directory
    late.until(lambda: set(hashes) <= late.removed.get("DISK", set()),
               "BlockRemoved DISK after another process's eviction")
    assert late.res.prefix_pages(hashes, "DISK") == 0
    b.generate(tokens)        # still served (recomputed); its pages are written back again
    late.until(lambda: late.holds(hashes, "DISK"), "DISK events of the re-written pages")


def _two_replicas_see_each_others_pages(servers: Callable[..., LaunchedServer], tmp_path: Path,
                                        model: Path, **shared: object
                                        ) -> tuple[list[int], Watch]:
    """Two servers sharing a tier: each one's subscriber sees EXTERNAL events of the other's
    pages (and none of them in its own GPU or DISK tier). Returns A's hashes and A's watch."""
    from offload.events.subscribe import prompt_hashes

    pa, pb = free_port(), free_port()
    small = {"max-total-tokens": 16384, "hicache-ratio": 2}    # two servers at once
    a = servers(tmp_path / "store-a", name="replica-a", sglang={**kv_events(pa), **small},
                model=model, **shared)
    b = servers(tmp_path / "store-b", name="replica-b", sglang={**kv_events(pb), **small},
                model=model, **shared)
    wa, wb = Watch(pa), Watch(pb)
    ta, tb = ids(2), ids(3)
    ra, rb = a.generate(ta), b.generate(tb)
    ha = prompt_hashes(ta, PAGE)[:full_pages(ra.prompt_tokens) // PAGE]
    hb = prompt_hashes(tb, PAGE)[:full_pages(rb.prompt_tokens) // PAGE]
    wb.until(lambda: wb.holds(ha, "EXTERNAL"), "replica B's EXTERNAL events of A's pages")
    wa.until(lambda: wa.holds(hb, "EXTERNAL"), "replica A's EXTERNAL events of B's pages")
    assert wb.res.prefix_pages(ha, "GPU") == 0 and wb.res.prefix_pages(ha, "DISK") == 0
    # B's first request of A's prompt: A's pages, in no tier of B's own, come from the one they
    # share, with A's greedy tokens
    hit = b.generate(ta)
    assert_agrees(ra, hit, "replica B's hit of replica A's pages", model)
    assert hit.cached_tokens == full_pages(ra.prompt_tokens), hit
    assert hit.details.get("storage", 0) > 0, hit.details
    return ha, wa


def test_two_replicas_on_one_redis_see_external_events_of_each_others_pages(
        servers: Callable[..., LaunchedServer], tmp_path: Path, real_model: Path) -> None:
    from tests.store.redis_fixtures import RedisProc

    redis = RedisProc(tmp_path / "redis", []).start()
    try:
        ha, wa = _two_replicas_see_each_others_pages(servers, tmp_path, real_model,
                                                     redis={"url": redis.url})
        wa.until(lambda: wa.holds(ha, "DISK"), "replica A's DISK events of its own pages")
    finally:
        redis.kill()


def test_two_replicas_on_one_agent_see_external_events_of_each_others_pages(
        servers: Callable[..., LaunchedServer], tmp_path: Path, real_model: Path) -> None:
    """The dpu path: both replicas' blocks live on one agent (the store they share), named to
    each other through the agent's announcement feed (ANNOUNCE / FEED)."""
    from tests.agent.conftest import SECRET, AgentProc, needs_nixl

    if needs_nixl.args[0]:
        pytest.skip(needs_nixl.kwargs["reason"])
    agent = AgentProc(tmp_path, ["--memory"]).start()
    try:
        hosts = Path(__file__).resolve().parents[1] / "fixtures" / "hosts" / "h100-bf3-dpu"
        _two_replicas_see_each_others_pages(
            servers, tmp_path, real_model, launch_args=("--root", str(hosts)),
            env={"SGLANG_OFFLOAD_SECRET": SECRET.decode()}, transfer={"path": "dpu"},
            agent={"address": agent.address, "transport": "ucx", "timeout_s": 10})
    finally:
        agent.stop()
