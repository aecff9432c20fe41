"""Issue 27, red team: a host disconnects while the agent's READs of its memory are in flight.

The attacker's NIXL endpoint lives in a child process that the test stops (UCX over TCP needs the
target's progress: the READs hang), so its PUTs outlive their 1 ms budgets and their slots or
staging are quarantined. Then its control connection closes (`drop_peer`). Before the fix the
quarantined memory was freed right there, while UCX could still complete the READs: on the DRAM
tier the late bytes landed in slots already handed to the victim (served under the victim's keys,
with valid checksums, or a checksum miss); on the disk store the staging was unmapped under UCX
(SIGSEGV, every tenant loses service). The child is then resumed so that the late READs land.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from offload.agent import protocol
from tests.agent.conftest import needs_nixl, wait_for
from tests.agent.tenants import NS, SECRETS, STALLED_HOST, host, keys_file, stalled_attacker

pytestmark = pytest.mark.slow

BLOCK, BLOCKS = 256 << 10, 16


def _late_reads_then_victim(agent, tmp_path: Path, rounds: int = 3) -> tuple[int, int, dict]:
    """(blocks served to the victim with bytes not its own, victim blocks missed, the agent's
    counters after the attacker left)."""
    child = subprocess.Popen([sys.executable, "-c", STALLED_HOST, str(BLOCK * BLOCKS)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ),
                             text=True)
    victim = None
    wrong = missed = 0
    try:
        raw, addr = stalled_attacker(agent, child)
        victim = host(agent, "victim", connections=1)
        pool = np.frombuffer(os.urandom(BLOCK * BLOCKS), np.uint8).copy()
        out = np.zeros(BLOCK * BLOCKS, np.uint8)
        victim.register_region(pool)
        victim.register_region(out)
        child.send_signal(signal.SIGSTOP)              # the attacker's READs hang from here
        keys = [NS["attacker"].key(f"late-{i}") for i in range(BLOCKS)]
        reply = raw.call(protocol.PUT, protocol.Blocks(
            keys=keys, sizes=[BLOCK] * BLOCKS, budget_ms=100,
            descs=[[(addr + i * BLOCK, BLOCK)] for i in range(BLOCKS)]))[0]
        assert not isinstance(reply, protocol.ErrorReply), reply
        raw.ch.sock.close()                            # the attacker leaves: drop_peer
        assert wait_for(lambda: victim.stats().extra.get("agent_nixl_peers") == 1, 20)
        extra = victim.stats().extra
        for r in range(rounds):
            kv = [NS["victim"].key(f"v{r}-{i}") for i in range(BLOCKS)]
            views = [[memoryview(pool[i * BLOCK:(i + 1) * BLOCK])] for i in range(BLOCKS)]
            assert victim.put_many(kv, views) == [True] * BLOCKS
            if r == 0:
                child.send_signal(signal.SIGCONT)      # the late READs land now
                time.sleep(1.0)
            out[:] = 0
            got = victim.get_many(kv, [[memoryview(out[i * BLOCK:(i + 1) * BLOCK])]
                                       for i in range(BLOCKS)])
            for i, f in enumerate(got):
                same = np.array_equal(out[i * BLOCK:(i + 1) * BLOCK],
                                      pool[i * BLOCK:(i + 1) * BLOCK])
                wrong += f and not same
                missed += not f
        assert agent.proc.poll() is None, f"the agent died: {agent.proc.returncode}"
    finally:
        child.send_signal(signal.SIGCONT)
        child.kill()
        child.wait(10)
        if victim is not None:
            victim.close()
    return wrong, missed, extra


@needs_nixl
def test_a_late_read_never_lands_in_another_tenants_dram_slots(tmp_path: Path, agent_factory,
                                                               monkeypatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")
    agent = agent_factory("--memory", "--capacity", "256MiB", "--memory-reserve", "64MiB",
                          "--keys-file", str(keys_file(tmp_path, SECRETS)))
    wrong, missed, extra = _late_reads_then_victim(agent, tmp_path)
    assert extra.get("agent_blocks_quarantined", 0) > 0, "no READ outlived its budget"
    assert (wrong, missed) == (0, 0), f"{wrong} victim blocks served with the attacker's bytes, " \
                                      f"{missed} missed"


@needs_nixl
def test_a_late_read_into_staging_never_kills_the_agent(tmp_path: Path, agent_factory,
                                                        monkeypatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")
    agent = agent_factory("--store", str(tmp_path / "store"), "--capacity", "256MiB",
                          "--keys-file", str(keys_file(tmp_path, SECRETS)))
    wrong, missed, extra = _late_reads_then_victim(agent, tmp_path)
    assert agent.proc.poll() is None
    assert extra.get("agent_staging_quarantined", 0) > 0, "no READ outlived its budget"
    assert (wrong, missed) == (0, 0), f"{wrong} victim blocks wrong, {missed} missed"
