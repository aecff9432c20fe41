"""Issue 18, red team: a host that stalls its own NIXL endpoint cannot fill the agent's quarantine.

Its PUTs' READs never finish (its process is stopped, UCX over TCP needs the target's progress),
so every request past its budget leaves its slots quarantined. Before the bound, one tenant
could hold the whole DRAM tier that way; now what its transfers hold is capped per host key
(`--max-quarantine`) and another tenant keeps its service.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from offload.agent import protocol
from tests.agent.conftest import needs_nixl
from tests.agent.tenants import NS, SECRETS, STALLED_HOST, host, keys_file, stalled_attacker

pytestmark = pytest.mark.slow

BLOCK, BLOCKS = 1 << 20, 4


LIMIT = 4 << 20


@needs_nixl
def test_a_stalled_host_cannot_fill_the_quarantine(tmp_path: Path, agent_factory, monkeypatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")
    agent = agent_factory("--memory", "--capacity", "256MiB", "--memory-reserve", "16MiB",
                          "--keys-file", str(keys_file(tmp_path, SECRETS)),
                          "--max-quarantine", str(LIMIT))
    child = subprocess.Popen([sys.executable, "-c", STALLED_HOST, str(BLOCK * BLOCKS)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ),
                             text=True)
    victim = None
    try:
        raw, addr = stalled_attacker(agent, child)
        child.send_signal(signal.SIGSTOP)          # its endpoint stops answering: READs hang
        refused = 0
        for r in range(8):
            keys = [NS["attacker"].key(f"s{r}-{i}") for i in range(BLOCKS)]
            reply = raw.call(protocol.PUT, protocol.Blocks(
                keys=keys, sizes=[BLOCK] * BLOCKS, budget_ms=1,
                descs=[[(addr + i * BLOCK, BLOCK)] for i in range(BLOCKS)]))[0]
            refused += isinstance(reply, protocol.ErrorReply) and "quarantine" in reply.message
        stats = raw.call(protocol.STATS, protocol.Empty())[0]
        assert isinstance(stats, protocol.StatsReply)
        held = stats.fields.get("agent_quarantined_bytes_now", 1 << 62)
        assert held <= LIMIT + BLOCK * BLOCKS, f"{held} bytes quarantined, limit {LIMIT}"
        assert refused >= 1 and stats.fields["agent_rejected_quarantine"] == refused
        # Another tenant is not affected by what the attacker's transfers hold.
        victim = host(agent, "victim")
        pool = np.frombuffer(os.urandom(BLOCK), np.uint8).copy()
        out = np.zeros(BLOCK, np.uint8)
        victim.register_region(pool)
        victim.register_region(out)
        k = NS["victim"].key("v")
        assert victim.put_many([k], [[memoryview(pool)]]) == [True]
        assert victim.get_many([k], [[memoryview(out)]]) == [True]
        assert np.array_equal(out, pool)
    finally:
        child.kill()
        child.wait(10)
        if victim is not None:
            victim.close()


def test_claims_and_holdings_of_one_owner_stay_within_its_bound() -> None:
    """What a request may leave in quarantine is what the bound leaves after the owner's held
    transfers and its other requests' claims; another owner's are not counted."""
    from offload.agent.quarantine import Quarantine

    class Proc:                      # every transfer still running (until `done`)
        done: set[str] = set()

        def check_xfer_state(self, h: str) -> str:
            return "DONE" if h in self.done else "PROC"

        def release_xfer_handle(self, h: str) -> None:
            pass

    agent = Proc()
    q = Quarantine(agent)
    assert q.claim("a", 6, 10) == 6 and q.claim("a", 6, 10) == 4 and q.claim("b", 10, 10) == 10
    q.hold("h1", "peer-a", 1, lambda: None, owner="a", nbytes=6)
    q.unclaim("a", 6)                # the first request ended, its transfer quarantined
    q.unclaim("a", 4)
    assert q.held_bytes("a") == 6 and q.held_bytes() == 6 and q.claim("a", 10, 10) == 4
    q.unclaim("a", 4)
    q.unclaim("b", 10)
    # Its peer dropped while the transfer runs: held (and the peer not forgotten) until final.
    forgotten: list[str] = []
    assert q.drop_peer("peer-a", lambda: forgotten.append("peer-a")) == 0
    assert q.held_bytes("a") == 6 and forgotten == [] and q.dying() == 1
    agent.done.add("h1")
    assert q.reap() == 1 and forgotten == ["peer-a"] and q.dying() == 0
    assert q.claim("a", 10, 10) == 10
