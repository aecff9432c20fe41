"""Issue 18, red team: NIXL metadata spliced from the attacker's own endpoint and the victim's
registered memory (its remote keys, copied from the victim's HELLO on the wire).

The proof notification then goes to a worker the attacker controls, so it proves the endpoint;
what must hold is that the victim's remote keys reach nothing through that endpoint: every
transfer lands in the attacker's own address space (here the attacker maps its own memory at the
victim's address, so the agent's READ finds the attacker's bytes there, not the victim's).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from offload.agent import protocol
from tests.agent.conftest import needs_nixl
from tests.agent.tenants import NS, PAGE, Raw

# The attacker's host process: its own NIXL agent; maps memory of its own at the address it is
# given (the victim's pool), fills it with 0x41 and writes the proof's MAC at that address.
ATTACKER = r"""
import ctypes, sys, time
import numpy as np
from offload.agent import nixl_util
a = nixl_util.make_agent("attacker/splice")
own = np.zeros(4096, np.uint8)
a.register_memory([(own.ctypes.data, own.nbytes, 0, "")], "DRAM")
print(a.get_agent_metadata().hex(), flush=True)
want = int(sys.stdin.readline())
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
page = want // 4096 * 4096
p = libc.mmap(page, 1 << 20, 3, 0x22 | 0x100000, -1, 0)    # MAP_PRIVATE|ANONYMOUS|FIXED_NOREPLACE
print(int(p == page), flush=True)
ctypes.memset(page, 0x41, 1 << 20)
notes = []
while not notes:
    notes = [bytes(m) for msgs in a.get_new_notifs().values() for m in msgs]
    time.sleep(0.01)
print(notes[0].hex(), flush=True)
ctypes.memmove(want, bytes.fromhex(sys.stdin.readline()), 32)
print("ok", flush=True)
time.sleep(600)
"""


def _splice(own: bytes, victims: bytes) -> bytes:
    """The attacker's metadata (name, endpoint) with the victim's memory sections."""
    cut = b"MemSection"
    return own[:own.index(cut)] + victims[victims.index(cut):]


@needs_nixl
def test_victims_remote_keys_reach_nothing_through_the_attackers_endpoint(tenants) -> None:
    agent, victim, pool, md = tenants
    child = subprocess.Popen([sys.executable, "-c", ATTACKER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdin is not None and child.stdout is not None
        own = bytes.fromhex(child.stdout.readline().strip())
        addr = int(pool.ctypes.data)
        child.stdin.write(f"{addr}\n")
        child.stdin.flush()
        if child.stdout.readline().strip() != "1":
            pytest.skip("the victim's address is taken in the attacker's process")
        bad = Raw(agent, "attacker", _splice(own, md))
        assert isinstance(bad.info, protocol.HelloReply) and bad.info.nixl
        nonce = bytes.fromhex(child.stdout.readline().strip())[
            len(protocol.PROOF_MAGIC) + protocol.PROOF_TAG_BYTES:]
        child.stdin.write(bad.ch.proof(nonce).hex() + "\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "ok"
        assert bad.call(protocol.PROVE, protocol.Prove([nonce], addr))[0] == protocol.Empty()
        ka = NS["attacker"].key("spliced")
        reply, _ = bad.call(protocol.PUT, protocol.Blocks(keys=[ka], sizes=[PAGE],
                                                          descs=[[(addr + 64, PAGE)]]))
        reply, data = bad.call(protocol.GET, protocol.Blocks(keys=[ka], sizes=[PAGE]))
        assert bytes(data) != pool[64:64 + PAGE].tobytes(), "the victim's memory was read"
        if reply.ok == [True]:                                     # type: ignore[attr-defined]
            assert bytes(data) == b"\x41" * PAGE                   # the attacker's own bytes
    finally:
        child.kill()
        child.wait(10)
