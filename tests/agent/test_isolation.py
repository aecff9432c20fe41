"""Issue 18: tenants of one shared agent, each holding its own valid key, against each other.

A renamed copy of another host's NIXL metadata (replayed from its HELLO) and descriptors forged to
point at that host's memory; the memory a late NIXL transfer may still touch; quotas per key.
Each asserts that the attack did not take effect and that the victim keeps its service.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from offload.agent import protocol
from offload.agent.access import register_msg
from offload.keys import Namespace
from tests.agent.conftest import needs_nixl, wait_for
from tests.agent.tenants import NS, PAGE, SECRETS, Raw, host, keys_file, renamed

pytestmark = pytest.mark.slow


def refused_or_false(reply: protocol.Msg) -> bool:
    return isinstance(reply, protocol.ErrorReply) or reply.ok == [False]   # type: ignore[attr-defined]


@needs_nixl
def test_renamed_metadata_replay_reads_none_of_the_victims_memory(tenants) -> None:
    """The attacker replays the victim's metadata under its own name, then PUTs descriptors that
    point at the victim's KV pool and reads the block back inline."""
    agent, victim, pool, md = tenants
    bad = Raw(agent, "attacker", renamed(md, "attacker/replayed"))
    ka = NS["attacker"].key("stolen")
    victim_page = (pool.ctypes.data + 2 * PAGE, PAGE)
    reply, _ = bad.call(protocol.PUT, protocol.Blocks(keys=[ka], sizes=[PAGE], descs=[[victim_page]]))
    assert refused_or_false(reply)
    reply, data = bad.call(protocol.GET, protocol.Blocks(keys=[ka], sizes=[PAGE]))
    assert bytes(data) != pool[2 * PAGE:3 * PAGE].tobytes(), "the victim's memory was read"
    assert reply.ok == [False]                                     # type: ignore[attr-defined]


@needs_nixl
def test_a_nonce_read_on_the_wire_proves_nothing(tenants) -> None:
    """An observer of the storage network reads the nonce the agent sends to the victim's endpoint
    for the attacker's replayed metadata, and echoes it. Before the MAC read back, that proved the
    victim's endpoint to the attacker: it then read the victim's pool into its own block."""
    agent, victim, pool, md = tenants
    bad = Raw(agent, "attacker", renamed(md, "attacker/replayed"))
    assert isinstance(bad.info, protocol.HelloReply)
    sniffed = victim.proof_nonces(bad.info.proof_tag, time.monotonic() + 5)   # the wire's bytes
    assert sniffed, "the nonce never reached the victim's endpoint"
    for addr in (pool.ctypes.data, pool.ctypes.data + 5 * PAGE):     # where the victim's bytes lie
        reply, _ = bad.call(protocol.PROVE, protocol.Prove(sniffed, addr))
        assert isinstance(reply, protocol.ErrorReply) and "not proven" in reply.message
    ka = NS["attacker"].key("sniffed")
    reply, _ = bad.call(protocol.PUT, protocol.Blocks(keys=[ka], sizes=[PAGE],
                                                      descs=[[(pool.ctypes.data, PAGE)]]))
    assert refused_or_false(reply)
    reply, data = bad.call(protocol.GET, protocol.Blocks(keys=[ka], sizes=[PAGE]))
    assert reply.ok == [False] and bytes(data) != pool[:PAGE].tobytes()   # type: ignore[attr-defined]


@needs_nixl
def test_forged_descriptors_write_nothing_into_the_victims_memory(tenants) -> None:
    """The attacker stores its own block inline, then GETs it with descriptors that point at the
    victim's KV pool, through the replayed metadata."""
    agent, victim, pool, md = tenants
    before = pool.copy()
    bad = Raw(agent, "attacker", renamed(md, "attacker/replayed"))
    ka = NS["attacker"].key("evil")
    reply, _ = bad.call(protocol.PUT, protocol.Blocks(keys=[ka], sizes=[PAGE]),
                        [memoryview(b"EVIL" * (PAGE // 4))])
    assert reply.ok == [True]                                      # type: ignore[attr-defined]
    victim_page = (pool.ctypes.data + 3 * PAGE, PAGE)
    reply, _ = bad.call(protocol.GET, protocol.Blocks(keys=[ka], sizes=[PAGE], descs=[[victim_page]]))
    assert refused_or_false(reply)
    assert np.array_equal(pool, before), "the attacker's bytes were written into the victim's pool"


@needs_nixl
def test_an_endpoint_is_proven_again_after_each_metadata_update(tenants) -> None:
    """A guess at the nonce fails; a proven endpoint whose metadata is replaced in place by a
    renamed copy of the victim's (same NIXL name) is unproven again."""
    from offload.agent import nixl_util

    agent, victim, pool, md = tenants
    mine = nixl_util.make_agent("attacker/own")
    buf = np.zeros(PAGE, np.uint8)
    mine.register_memory([(buf.ctypes.data, PAGE, 0, "")], "DRAM")
    bad = Raw(agent, "attacker", mine.get_agent_metadata())
    info = bad.info
    assert isinstance(info, protocol.HelloReply) and info.nixl
    reply, _ = bad.call(protocol.PROVE, protocol.Prove([os.urandom(32)], buf.ctypes.data))  # a guess
    assert isinstance(reply, protocol.ErrorReply)
    # A new challenge (METADATA), answered from what its own endpoint received: proven.
    bad.call(protocol.METADATA, protocol.Metadata(mine.get_agent_metadata()))
    got: list[bytes] = []

    def nonce() -> bool:
        for msgs in mine.get_new_notifs().values():
            got.extend(m[4 + 16:] for m in msgs if m[4:20] == info.proof_tag)
        return bool(got)

    assert wait_for(nonce, 5)
    buf[:32] = np.frombuffer(bad.ch.proof(got[-1]), np.uint8)   # its MAC, for the agent to read
    assert bad.call(protocol.PROVE, protocol.Prove(got[-1:], buf.ctypes.data))[0] == protocol.Empty()
    ka = NS["attacker"].key("own")
    reply, _ = bad.call(protocol.PUT, protocol.Blocks(keys=[ka], sizes=[PAGE],
                                                      descs=[[(buf.ctypes.data, PAGE)]]))
    assert reply.ok == [True]                                      # type: ignore[attr-defined]
    # Outside its own registered memory: refused.
    reply, _ = bad.call(protocol.PUT, protocol.Blocks(keys=[NS["attacker"].key("x")], sizes=[PAGE],
                                                      descs=[[(pool.ctypes.data, PAGE)]]))
    assert isinstance(reply, protocol.ErrorReply) and "outside the memory" in reply.message
    # The victim's metadata renamed to this proven name: refused by NIXL, or loaded in place
    # and then unproven; either way the victim's memory stays out of reach.
    update, _ = bad.call(protocol.METADATA, protocol.Metadata(renamed(md, "attacker/own")))
    reply, _ = bad.call(protocol.PUT, protocol.Blocks(keys=[NS["attacker"].key("y")], sizes=[PAGE],
                                                      descs=[[(pool.ctypes.data, PAGE)]]))
    assert isinstance(reply, protocol.ErrorReply)
    assert ("not proven" if update == protocol.Empty() else "outside the memory") in reply.message
    assert victim.stats().extra["agent_proofs_failed"] >= 1


@needs_nixl
def test_aborted_transfers_never_give_another_tenant_wrong_bytes(tmp_path: Path, agent_factory,
                                                                  monkeypatch) -> None:
    """The attacker's PUTs have 1 ms budgets (UCX over TCP: their READs outlive them); each is
    followed by a victim's PUT of the same block size, then its GET. A late READ landing in a slot
    handed to the victim would be read back as the victim's block."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    agent = agent_factory("--memory", "--keys-file", str(keys_file(tmp_path, SECRETS)))
    size, n = 256 << 10, 32
    attacker, victim = host(agent, "attacker"), host(agent, "victim")
    a_pool = np.full(n * size, 0xEE, np.uint8)
    v_pool = np.frombuffer(os.urandom(size), np.uint8).copy()
    out = np.zeros(size, np.uint8)
    for s, p in ((attacker, a_pool), (victim, v_pool), (victim, out)):
        s.register_region(p)
    try:
        attacker._budget_ms = lambda _d: 1           # type: ignore[method-assign]
        wrong = 0
        for r in range(6):
            ka = [NS["attacker"].key(f"a{r}-{i}") for i in range(n)]
            attacker.put_many(ka, [[memoryview(a_pool[i * size:(i + 1) * size])] for i in range(n)])
            kv = NS["victim"].key(f"v{r}")
            if victim.put_many([kv], [[memoryview(v_pool)]]) != [True]:
                continue
            for _ in range(3):        # late bytes of the attacker's READs keep arriving meanwhile
                out[:] = 0
                if victim.get_many([kv], [[memoryview(out)]]) == [True]:
                    wrong += not np.array_equal(out, v_pool)
        assert wrong == 0, f"{wrong} reads gave the victim bytes that are not its block's"
        extra = victim.stats().extra
        assert extra.get("agent_blocks_quarantined", 0) > 0, "no transfer outlived its budget"
    finally:
        attacker.close()
        victim.close()


def _ns(name: str, i: int) -> Namespace:
    return Namespace(**{**NS[name].__dict__, "model": f"junk-{i}"})


def test_one_tenant_filling_its_tables_never_refuses_another(tmp_path: Path, agent_factory) -> None:
    """Quotas are per host key: the attacker's connections and namespaces run out, the victim's
    do not; the attacker's namespaces expire with its last connection."""
    agent = agent_factory("--memory", "--transport", "tcp", "--keys-file",
                          str(keys_file(tmp_path, SECRETS)), "--max-clients", "2",
                          "--max-namespaces", "8")
    flood = [Raw(agent, "attacker", None) for _ in range(2)]
    for i in range(7):                     # 1 + 7: its quota of namespaces
        assert flood[0].call(protocol.REGISTER_NS, register_msg(_ns("attacker", i)))[0] == \
            protocol.Empty()
    reply = flood[1].call(protocol.REGISTER_NS, register_msg(_ns("attacker", 99)))[0]
    assert isinstance(reply, protocol.ErrorReply) and "registered 8 namespaces" in reply.message
    third = host(agent, "attacker", transport="tcp")
    assert third.put_many([NS["attacker"].key("x")], [[b"x"]]) == [False]   # refused at HELLO
    third.close()
    victim = host(agent, "victim", transport="tcp")
    try:
        for i in range(7):
            victim.register_namespace(_ns("victim", i))
        k = _ns("victim", 6).key("p")
        assert victim.put_many([k], [[b"victim"]]) == [True]
        buf = bytearray(6)
        assert victim.get_many([k], [[buf]]) == [True] and bytes(buf) == b"victim"
        assert victim.stats().extra["agent_rejected_full"] >= 1
        # The attacker's registrations expire with its last connection: it may register again.
        for r in flood:
            r.ch.sock.close()
        assert wait_for(lambda: victim.stats().extra["agent_quota_namespaces"] == 8)
        again = Raw(agent, "attacker", None)
        assert again.call(protocol.REGISTER_NS, register_msg(_ns("attacker", 99)))[0] == \
            protocol.Empty()
    finally:
        victim.close()


def test_reachability_probe_is_a_debug_line_not_noise(tmp_path: Path, agent_factory) -> None:
    """`detect` connects and closes (here with a reset, as a probe that never reads does)."""
    import struct

    agent = agent_factory("--memory", "--transport", "tcp", "--keys-file",
                          str(keys_file(tmp_path, SECRETS)))
    for linger in (False, True):
        sock = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
        if linger:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    s = host(agent, "victim", transport="tcp")
    try:
        assert s.put_many([NS["victim"].key("p")], [[b"x"]]) == [True]
    finally:
        s.close()
    assert wait_for(lambda: "connected from" in agent.text())
    text = agent.text()
    assert "reset by peer" not in text and "ended" not in text and "rejected" not in text


@needs_nixl
def test_aborted_staging_transfer_never_lands_in_a_later_block(tmp_path: Path, agent_factory,
                                                               monkeypatch) -> None:
    """The disk store's staging path: a 4 ms PUT whose READ outlives it (its staging memory is
    quarantined), then small PUTs on the same connection and their GETs: no late byte in them.
    (A regression guard for the staging quarantine; the race rarely hit the old code here.)"""
    monkeypatch.setenv("UCX_TLS", "tcp")
    agent = agent_factory("--store", str(tmp_path / "store"), "--capacity", "256MiB",
                          "--keys-file", str(keys_file(tmp_path, SECRETS)))
    size, n = 256 << 10, 128
    s = host(agent, "victim", connections=1)
    junk = np.full(n * size, 0xEE, np.uint8)
    mine = np.frombuffer(os.urandom(n * size), np.uint8).copy()
    out = np.zeros(n * size, np.uint8)
    for p in (junk, mine, out):
        s.register_region(p)
    try:
        budget = s._budget_ms
        wrong = 0
        for r in range(3):
            s._budget_ms = lambda _d: 4                      # type: ignore[method-assign]
            s.put_many([NS["victim"].key(f"j{r}-{i}") for i in range(n)],
                       [[memoryview(junk[i * size:(i + 1) * size])] for i in range(n)])
            s._budget_ms = budget                          # type: ignore[method-assign]
            for i in range(4):           # small PUTs: done before the late READ's last bytes
                k, blk = NS["victim"].key(f"m{r}-{i}"), mine[i * size:(i + 1) * size]
                if s.put_many([k], [[memoryview(blk)]]) != [True]:
                    continue
                out[:size] = 0
                if s.get_many([k], [[memoryview(out[:size])]]) == [True]:
                    wrong += not np.array_equal(out[:size], blk)
        assert wrong == 0, f"{wrong} blocks were stored or served with another request's bytes"
    finally:
        s.close()


@needs_nixl
def test_descriptors_that_wrap_or_straddle_are_outside_the_registered_memory() -> None:
    """NIXL's own check computes a descriptor's end modulo 2**64: (2**64 - 8, 16) 'lay in' any
    registered region before the agent refused wrapping descriptors itself."""
    from offload.agent import nixl_util
    from offload.agent.mover import Mover

    host_agent = nixl_util.make_agent("wrap-host")
    buf = np.zeros(4 * PAGE, np.uint8)
    host_agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    mover = Mover("wrap-agent")
    peer = mover.add_peer(host_agent.get_agent_metadata(), 1, "wrap-host")
    b, n = buf.ctypes.data, buf.nbytes
    assert mover.covers(peer, [(b, n)]) and mover.covers(peer, [(b + PAGE, PAGE), (b, 8)])
    for bad in ([(2**64 - 8, 16)], [(b + 8, 2**64 - 8)], [(b + n - 8, 16)], [(b - 8, 16)],
                [(b, 0)], [(b, 8), (b + n, 8)]):
        assert not mover.covers(peer, bad), bad
    mover.drop_peer(peer, 1)
