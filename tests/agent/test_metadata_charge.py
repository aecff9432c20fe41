"""Issue 36 round 2, red team: the NIXL metadata a connection has the agent load (its bytes, and
what NIXL builds from them: a remote agent with a key per registered region) is held for that
connection's life, so it is charged to its host key before it is loaded and given back when the
connection lets it go (`Session._load`, `offload.agent.budget`).

On 29ab695 it was not charged: 12 connections of one key, each loading metadata of 20,000
registered regions (~0.9 MiB, ~7 MiB in NIXL) under a name of its own, grew the agent ~90 MiB
against `--max-memory 16MiB`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from offload.agent import protocol
from tests.agent.conftest import needs_nixl, wait_for
from tests.agent.tenants import SECRETS, Raw, keys_file, renamed, rss, stats

pytestmark = pytest.mark.slow

REGIONS = 20_000
CONNS = 12                 # within the (key, endpoint) challenge burst of 16
MIB = 1 << 20
BIG = """
import sys
import numpy as np
from offload.agent import nixl_util
a = nixl_util.make_agent("attacker")
n = int(sys.argv[1])
buf = np.zeros(4096 * n, np.uint8)
a.register_memory([(buf.ctypes.data + 4096 * i, 4096, 0, "") for i in range(n)], "DRAM")
print(a.get_agent_metadata().hex(), flush=True)
sys.stdin.read()                    # alive (its endpoint answers) until the test ends
"""


@needs_nixl
def test_loaded_metadata_is_charged_to_its_key(tmp_path: Path, agent_factory) -> None:
    child = subprocess.Popen([sys.executable, "-c", BIG, str(REGIONS)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=dict(os.environ), text=True)
    try:
        assert child.stdout is not None
        md = bytes.fromhex(child.stdout.readline().strip())
        _attack(tmp_path, agent_factory, md)
    finally:
        child.kill()
        child.wait(10)


def _attack(tmp_path: Path, agent_factory, md: bytes) -> None:
    agent = agent_factory("--memory", "--max-memory", "16MiB", "--max-memory-per-key", "16MiB",
                          "--keys-file", str(keys_file(tmp_path, SECRETS)))
    conns = [Raw(agent, "attacker", None) for _ in range(CONNS)]
    probe = Raw(agent, "victim", None)
    before = rss(agent.proc.pid)
    replies = []
    for i, raw in enumerate(conns):
        raw.ch.io_timeout = 120.0
        replies.append(raw.call(protocol.METADATA,
                                protocol.Metadata(renamed(md, f"attacker/{i}")))[0])
    grown = rss(agent.proc.pid) - before
    fields = stats(probe)
    assert int(fields["agent_memory_held"]) <= 16 * MIB
    loaded = sum(r == protocol.Empty() for r in replies)
    assert grown < 48 * MIB, (f"the agent grew {grown >> 20} MiB with {loaded} metadata "
                              f"of {len(md) >> 10} KiB loaded (--max-memory 16MiB)")
    assert loaded >= 1, replies                  # within its budget, one is loaded
    # Given back with the connections that held them.
    for raw in conns:
        raw.ch.sock.close()
    assert wait_for(lambda: int(stats(probe)["agent_memory_held"]) < MIB, 60)
