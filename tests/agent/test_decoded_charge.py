"""Issue 36 round 2, red team: what a request makes the agent allocate once decoded (its Python
objects, the descriptor lists of its NIXL transfers) is charged to its host key before it is
allocated (`protocol.request_bound`, taken by `Session._dispatch`), like its frame and reply.

On 29ab695 only the frame was charged: a request's msgpack meta of at most 1 MiB decodes to up
to 21 times its size (a descriptor `(0, 1)` is 3 bytes of msgpack, a 64-byte tuple), and its
transfer builds two more descriptor lists (256 bytes a descriptor, measured). 16 connections of
one key whose endpoint stops answering each held one PUT of 32,768 descriptors (a 360 KiB
frame, charged 0.4 MiB) until its budget: the agent grew by ~190 MiB against `--max-memory
64MiB`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from offload.agent import protocol
from tests.agent.conftest import needs_nixl, wait_for
from tests.agent.tenants import NS, SECRETS, Raw, keys_file, rss, stats

pytestmark = pytest.mark.slow

# A host process with one NIXL endpoint and registered memory: prints its metadata and the
# memory's address; then per line "note TAG" the nonce of the proof notification under TAG,
# per line "mac OFFSET HEX" writes those bytes there ("ok").
HOST = """
import sys, time
import numpy as np
from offload.agent import nixl_util
a = nixl_util.make_agent("attacker")
buf = np.zeros(int(sys.argv[1]), np.uint8)
a.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
print(a.get_agent_metadata().hex(), buf.ctypes.data, flush=True)
seen = {}
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "note":
        tag = bytes.fromhex(cmd[1])
        while tag not in seen:
            for msgs in a.get_new_notifs().values():
                for m in msgs:
                    m = bytes(m)
                    seen[m[4:20]] = m[20:]
            time.sleep(0.01)
        print(seen.pop(tag).hex(), flush=True)
    else:
        off = int(cmd[1])
        buf[off:off + 32] = np.frombuffer(bytes.fromhex(cmd[2]), np.uint8)
        print("ok", flush=True)
"""
DESCS = protocol.MAX_DESCS_PER_REQUEST
BLOCKS = DESCS // protocol.MAX_DESCS_PER_BLOCK
CONNS = 16                     # the (key, endpoint) challenge burst: each connection proven
MIB = 1 << 20


def proven(agent, child: subprocess.Popen, md: bytes, addr: int, slot: int) -> Raw:
    """One more connection of the attacker, its endpoint (the child's) proven."""
    assert child.stdin is not None and child.stdout is not None
    raw = Raw(agent, "attacker", md)
    assert isinstance(raw.info, protocol.HelloReply) and raw.info.nixl, raw.info
    child.stdin.write(f"note {raw.info.proof_tag.hex()}\n")
    child.stdin.flush()
    nonce = bytes.fromhex(child.stdout.readline().strip())
    off = DESCS * 8 + 32 * slot
    child.stdin.write(f"mac {off} {raw.ch.proof(nonce).hex()}\n")
    child.stdin.flush()
    assert child.stdout.readline().strip() == "ok"
    assert raw.call(protocol.PROVE, protocol.Prove([nonce], addr + off))[0] == protocol.Empty()
    return raw


@needs_nixl
def test_held_requests_are_charged_what_they_decode_to(tmp_path: Path, agent_factory,
                                                      monkeypatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")
    agent = agent_factory("--memory", "--capacity", "64MiB", "--memory-reserve", "16MiB",
                          "--max-memory", "64MiB", "--max-memory-per-key", "64MiB",
                          "--keys-file", str(keys_file(tmp_path, SECRETS)))
    child = subprocess.Popen([sys.executable, "-c", HOST, str(DESCS * 8 + 32 * CONNS)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ),
                             text=True)
    conns: list[Raw] = []
    try:
        assert child.stdout is not None
        md_hex, addr_s = child.stdout.readline().split()
        md, addr = bytes.fromhex(md_hex), int(addr_s)
        conns = [proven(agent, child, md, addr, i) for i in range(CONNS)]
        probe = Raw(agent, "victim", None)
        refused0 = int(stats(probe).get("agent_bad_requests", 0))
        before = rss(agent.proc.pid)
        child.send_signal(signal.SIGSTOP)          # its endpoint stops answering: READs hang
        for r, raw in enumerate(conns):            # one PUT each, held until its budget
            keys = [NS["attacker"].key(f"held-{r}-{b}") for b in range(BLOCKS)]
            per = protocol.MAX_DESCS_PER_BLOCK
            raw.req += 1
            raw.ch.send(protocol.PUT, raw.req, protocol.Blocks(
                keys=keys, sizes=[8 * per] * BLOCKS, budget_ms=600_000,
                descs=[[(addr + (b * per + j) * 8, 8) for j in range(per)]
                       for b in range(BLOCKS)]))

        def answered() -> bool:        # each PUT refused, or decoded and in progress
            f = stats(probe)
            return (int(f.get("agent_bad_requests", 0)) - refused0
                    + int(f.get("agent_quota_requests", 0)) - 1) >= CONNS
        assert wait_for(answered, 120)
        grown = rss(agent.proc.pid) - before
        fields = stats(probe)
        assert int(fields["agent_memory_held"]) <= 64 * MIB
        assert grown < 96 * MIB, (f"the agent grew {grown >> 20} MiB holding "
                                  f"{int(fields['agent_quota_requests']) - 1} requests "
                                  f"(--max-memory 64MiB)")
    finally:
        child.kill()
        child.wait(10)
        for raw in conns:
            raw.ch.sock.close()
