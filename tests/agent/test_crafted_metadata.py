"""Issue 27, red team: an authenticated tenant sends NIXL metadata crafted to make UCX abort.

Its own metadata with the first 8 bytes of its UCX worker address changed: loaded by the agent's
NIXL agent as it was, UCX asserted (`address.c`, exit -6) and the other tenant went from 16/16 to
0/16. Now the agent checks what it can and loads new metadata in a child process first
(`offload.agent.vet`): the child dies, the metadata is refused, the agent and the other tenant go
on.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from offload.agent import protocol
from tests.agent.conftest import needs_nixl
from tests.agent.tenants import NS, SECRETS, Raw, host, keys_file, renamed

pytestmark = pytest.mark.slow

PAGE = 4096
CONN = b"|t" + (3).to_bytes(8, "little") + b"UCX|c"


def crafted(md: bytes, off: int = 0) -> bytes:
    """`md` with 8 bytes of its UCX worker address inverted, from byte `off` of the address."""
    i = md.index(CONN) + len(CONN) + 8 + off
    return md[:i] + bytes(b ^ 0xFF for b in md[i:i + 8]) + md[i + 8:]


def victim_serves(victim, pool: np.ndarray, n: int = 16) -> int:
    """Of n PUT + GET round trips of the victim, how many gave back its bytes."""
    out = np.zeros(PAGE, np.uint8)
    good = 0
    for i in range(n):
        k = NS["victim"].key(f"serve-{i}-{os.urandom(4).hex()}")
        blk = pool[i * PAGE:(i + 1) * PAGE]
        out[:] = 0
        good += (victim.put_many([k], [[memoryview(blk)]]) == [True]
                 and victim.get_many([k], [[memoryview(out)]]) == [True]
                 and np.array_equal(out, blk))
    return good


@needs_nixl
def test_crafted_metadata_never_aborts_the_agent(tmp_path: Path, agent_factory) -> None:
    agent = agent_factory("--memory", "--keys-file", str(keys_file(tmp_path, SECRETS)))
    victim = host(agent, "victim", connections=1)
    pool = np.frombuffer(os.urandom(16 * PAGE), np.uint8).copy()
    victim.register_region(pool)
    try:
        assert victim_serves(victim, pool) == 16
        md = victim.nixl_metadata()
        assert md is not None
        # The attacker's "own" metadata: the victim's, renamed, its worker address broken.
        bad = crafted(renamed(md, "attacker"))
        raw = Raw(agent, "attacker", bad)                 # in the HELLO
        assert isinstance(raw.info, protocol.HelloReply) and not raw.info.nixl
        reply = raw.call(protocol.METADATA, protocol.Metadata(bad))[0]     # and as an update
        assert isinstance(reply, protocol.ErrorReply) and "NIXL metadata" in reply.message
        assert agent.proc.poll() is None, f"the agent died: {agent.proc.returncode}"
        assert victim_serves(victim, pool) == 16
    finally:
        victim.close()


def test_what_can_be_checked_without_ucx_is() -> None:
    from offload.agent.vet import check_metadata

    head = b"nixlSerDes|Agent" + (1).to_bytes(8, "little") + b"a|Conns"
    addr = bytes([0x21]) + b"x" * 20
    good = head + CONN + len(addr).to_bytes(8, "little") + addr + b"|"
    assert check_metadata(good) is None
    assert "not NIXL metadata" in check_metadata(b"junk" + good)
    assert "without UCX" in check_metadata(head)
    assert "past its end" in check_metadata(head + CONN + (1 << 40).to_bytes(8, "little") + addr)
    assert "unknown version" in check_metadata(crafted(good))


@needs_nixl
def test_metadata_that_kills_ucx_kills_only_the_checker(monkeypatch) -> None:
    """What only UCX can check: past `check_metadata`, the child loads it and dies of it; the
    next metadata gets a fresh child."""
    from offload.agent import nixl_util, vet

    monkeypatch.setenv("UCX_MODULES", "^ib")
    a = nixl_util.make_agent("vet-probe")
    buf = np.zeros(PAGE, np.uint8)
    a.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    md = a.get_agent_metadata()
    monkeypatch.setattr(vet, "check_metadata", lambda md: None)     # as if it passed
    v = vet.Vetter()
    try:
        why = v.vet(crafted(md))
        assert why is not None and "crashes UCX" in why and v.crashes == 1
        assert v.vet(md) is None and v.vet(md) is None                # a new child; cached
    finally:
        v.close()


@needs_nixl
def test_a_key_whose_metadata_kills_the_checker_pays_the_restart(monkeypatch) -> None:
    """Issue 36 round 2: each crash costs the agent a new checker (NIXL imported again); the
    key that caused it pays a whole check (`VET_TIMEOUT_S`) of its checker time, so past its
    budget its next metadata is refused unchecked. On 29ab695 a crash cost the key ~1 ms: it
    could kill a checker per request (64 at once, then 8/s: its challenge rate), each restart
    paid by the agent and waited for by the next key."""
    from offload.agent import nixl_util, vet

    monkeypatch.setenv("UCX_MODULES", "^ib")
    a = nixl_util.make_agent("vet-crasher")
    buf = np.zeros(PAGE, np.uint8)
    a.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    md = a.get_agent_metadata()
    monkeypatch.setattr(vet, "check_metadata", lambda md: None)     # as if it passed
    # Its budget: two whole checks, refilled at a rate no test run can matter.
    v = vet.Vetter(timeout_s=10.0, budget_s=20.0, rate_s=1e-6)
    v.start()
    try:
        answers = [v.vet(crafted(md), "crasher") for _ in range(4)]
        assert all(x is not None and "crashes UCX" in x for x in answers[:2]), answers
        assert all(x is not None and "spent its NIXL metadata checker time" in x
                   for x in answers[2:]), answers
        assert v.crashes == 2
        assert v.vet(md, "victim") is None                  # another key: its own time
    finally:
        v.close()
