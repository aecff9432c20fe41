"""Issue 27, red team: notification amplification through METADATA.

Each METADATA made the agent send a fresh nonce to the endpoint the metadata names: an attacker
replaying a victim's metadata under its own name and sending METADATA in a loop had the agent
send the victim's endpoint one notification per request (44k-90k in 15 s, all kept by the
victim's process). Now challenges are bounded per key and per (key, endpoint)
(`offload.agent.rate`): past the burst the request is refused and nothing is sent; the victim's
own proofs (its own key's buckets) still work.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from offload.agent import protocol
from offload.agent.rate import PER_ENDPOINT
from tests.agent.conftest import needs_nixl
from tests.agent.tenants import COUNTER, NS, SECRETS, Raw, host, keys_file, renamed

pytestmark = pytest.mark.slow

FLOOD = 300


@needs_nixl
def test_a_metadata_flood_sends_the_victims_endpoint_a_bounded_number_of_nonces(
        tmp_path: Path, agent_factory) -> None:
    agent = agent_factory("--memory", "--keys-file", str(keys_file(tmp_path, SECRETS)))
    child = subprocess.Popen([sys.executable, "-c", COUNTER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=dict(os.environ), text=True)
    victim = None
    try:
        assert child.stdout is not None and child.stdin is not None
        md = renamed(bytes.fromhex(child.stdout.readline().strip()), "attacker")
        raw = Raw(agent, "attacker", None)
        refused = 0
        for _ in range(FLOOD):
            reply = raw.call(protocol.METADATA, protocol.Metadata(md))[0]
            refused += isinstance(reply, protocol.ErrorReply) and "too many" in reply.message
        child.stdin.close()
        received = int(child.stdout.readline())
        assert received <= PER_ENDPOINT + 8, f"{received} notifications for {FLOOD} requests"
        assert refused >= FLOOD - PER_ENDPOINT - 8
        # The victim's own key still proves its own endpoint and is served by NIXL.
        victim = host(agent, "victim")
        pool = np.frombuffer(os.urandom(4096), np.uint8).copy()
        victim.register_region(pool)
        assert victim.put_many([NS["victim"].key("v")], [[memoryview(pool)]]) == [True]
        assert victim._conns[0].nixl
        assert victim.stats().extra["agent_rejected_challenges"] == refused
    finally:
        child.kill()
        child.wait(10)
        if victim is not None:
            victim.close()


def test_buckets_refill_and_are_kept_per_key_and_endpoint() -> None:
    from offload.agent.rate import Challenges

    now = [0.0]
    c = Challenges(per_key=4, key_rate=1.0, per_endpoint=2, endpoint_rate=0.5,
                   clock=lambda: now[0])
    assert [c.take("a", b"e1") for _ in range(3)][:2] == [None, None]
    assert "one endpoint" in (c.take("a", b"e1") or "")
    assert c.take("a", b"e2") is None and c.take("a", b"e2") is None
    assert "this host key" in (c.take("a", b"e3") or "")       # the key's 4 are spent
    assert c.take("b", b"e1") is None                             # another key: its own buckets
    now[0] = 2.0                                                  # +2 key tokens, +1 endpoint
    assert c.take("a", b"e1") is None and c.take("a", b"e1") is not None
