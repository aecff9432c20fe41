"""Hosts of one agent as tenants, and what a hostile one sends by hand.

- `SECRETS`, `NS`, `keys_file`: two hosts (victim, attacker) with their own secrets and salts.
- `host(agent, name)`: a tenant's `AgentStore`; `Raw`: an authenticated connection driven by
  hand; `renamed`, `send_meta`: forged NIXL metadata and hand-made frames.
- `stats`, `rss`: what the agent reports and holds; `closed_by_peer`: a socket the agent closed.
- `STALLED_HOST`/`stalled_attacker`, `COUNTER`: NIXL endpoints as child processes.
The `tenants` fixture (tests/agent/conftest.py) builds a victim with a proven endpoint on them.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from offload.agent import protocol
from offload.agent.access import register_msg
from offload.agent.client import AgentStore
from offload.keys import Namespace

SECRETS = {"victim": "v" * 32, "attacker": "a" * 32}


NS = {h: Namespace(model="m", dtype="bf16", layout="page_first", page_size=16, salt=f"salt-{h}")
      for h in SECRETS}


PAGE = 4096


def keys_file(tmp_path: Path, hosts: dict[str, str]) -> Path:
    keys = tmp_path / "keys.toml"
    keys.write_text("".join(f'[hosts.{h}]\nsecret = "{s}"\nsalts = ["salt-{h}"]\n\n'
                            for h, s in hosts.items()))
    keys.chmod(0o600)
    return keys


def host(agent, name: str, transport: str = "ucx", **kw) -> AgentStore:
    s = AgentStore(agent.address, SECRETS[name].encode(), transport=transport, name=name,
                   timeout_s=kw.pop("timeout_s", 5), reconnect_s=0.1, **kw)
    s.register_namespace(NS[name])
    return s


def renamed(md: bytes, name: str) -> bytes:
    """NIXL metadata with only its agent-name field changed (`nixl_util.metadata_name`)."""
    prefix = b"nixlSerDes|Agent"
    n = int.from_bytes(md[len(prefix):len(prefix) + 8], "little")
    return prefix + len(name).to_bytes(8, "little") + name.encode() + md[len(prefix) + 8 + n:]


class Raw:
    """An authenticated connection driven by hand (what a hostile host sends)."""

    def __init__(self, agent, name: str, md: bytes | None):
        sock = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
        self.ch = protocol.handshake_client(sock, SECRETS[name].encode(), io_timeout=5)
        self.req = 0
        self.info = self.call(protocol.HELLO, protocol.Hello(
            host=name, transport="ucx" if md else "tcp", nixl_md=md))[0]
        self.call(protocol.REGISTER_NS, register_msg(NS[name]))

    def call(self, op: int, msg: protocol.Msg, payload: list[memoryview] | None = None
             ) -> tuple[protocol.Msg, memoryview]:
        self.req += 1
        self.ch.send(op, self.req, msg, payload)
        frame = self.ch.recv()
        if frame.op == protocol.ERROR | protocol.REPLY:
            return frame.decode(protocol.ErrorReply), frame.payload
        return frame.decode(protocol.REPLY_TYPES[op]), frame.payload


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def stats(raw: Raw) -> dict[str, int | float | str]:
    reply = raw.call(protocol.STATS, protocol.Empty())[0]
    assert isinstance(reply, protocol.StatsReply)
    return reply.fields


def closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def send_meta(ch: protocol.Channel, op: int, req_id: int, meta: bytes) -> None:
    """An authenticated frame with hand-made msgpack meta (what a buggy or hostile host sends)."""
    parts = [protocol.META_LEN.pack(len(meta)), meta]
    ch._send_seq += 1
    header = protocol.HEADER.pack(protocol.FRAME_MAGIC, protocol.VERSION, op, 0, req_id,
                                  ch._send_seq, sum(len(p) for p in parts))
    protocol.send_parts(ch.sock, [header, *parts, ch._mac(ch._out_dir, header, *parts)],
                        time.monotonic() + 30)


# A host process owning a NIXL endpoint with registered memory: prints its metadata and address,
# then the notification it receives (the proof nonce), then writes the proof's MAC it is given
# at that address.
STALLED_HOST = """
import sys, time
import numpy as np
from offload.agent import nixl_util
a = nixl_util.make_agent("attacker")
buf = np.full(int(sys.argv[1]), 0xEE, np.uint8)
a.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
print(a.get_agent_metadata().hex(), buf.ctypes.data, flush=True)
notes = []
while not notes:
    notes = [bytes(m) for msgs in a.get_new_notifs().values() for m in msgs]
    time.sleep(0.01)
print(notes[0].hex(), flush=True)
buf[:32] = np.frombuffer(bytes.fromhex(sys.stdin.readline()), np.uint8)
print("ok", flush=True)
time.sleep(600)
"""


def stalled_attacker(agent, child: subprocess.Popen) -> tuple[Raw, int]:
    """The attacker's authenticated connection, its endpoint (a STALLED_HOST child) proven;
    and the address of the child's registered memory."""
    assert child.stdout is not None and child.stdin is not None
    md, addr_s = child.stdout.readline().split()
    raw = Raw(agent, "attacker", bytes.fromhex(md))
    assert isinstance(raw.info, protocol.HelloReply) and raw.info.nixl
    note = bytes.fromhex(child.stdout.readline().strip())
    nonce = note[len(protocol.PROOF_MAGIC) + protocol.PROOF_TAG_BYTES:]
    child.stdin.write(raw.ch.proof(nonce).hex() + "\n")
    child.stdin.flush()
    assert child.stdout.readline().strip() == "ok"
    addr = int(addr_s)
    assert raw.call(protocol.PROVE, protocol.Prove([nonce], addr))[0] == protocol.Empty()
    return raw, addr


# The victim's endpoint: a NIXL agent that counts the notifications it receives until stdin
# closes, then prints the count.
COUNTER = """
import sys, threading, time
from offload.agent import nixl_util
a = nixl_util.make_agent("victim/endpoint")
print(a.get_agent_metadata().hex(), flush=True)
n, done = 0, threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
while not done.is_set():
    n += sum(len(m) for m in a.get_new_notifs().values())
    time.sleep(0.01)
time.sleep(0.5)
n += sum(len(m) for m in a.get_new_notifs().values())
print(n, flush=True)
"""
