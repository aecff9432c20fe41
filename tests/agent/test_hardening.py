"""Issue 14, the agent: hostile clients against a real agent process on loopback.

Floods of unauthenticated slow or oversized clients, descriptor bombs, EMFILE on accept, a host
using another tenant's namespaces or another host's name or NIXL metadata, unsafe host names, a
symlinked ready file, a client waiting on a trickling agent. Each asserts that the attack did not
take effect and that the agent keeps serving an authenticated host.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from offload.agent import protocol
from offload.agent.client import AgentStore
from offload.keys import Namespace
from tests.agent.conftest import SECRET, needs_nixl, recording_sends, wait_for
from tests.agent.tenants import send_meta

pytestmark = pytest.mark.slow

KEY = b"K" * 32


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def store(agent, secret: bytes = SECRET, **kw) -> AgentStore:
    return AgentStore(agent.address, secret, transport=kw.pop("transport", "tcp"),
                      timeout_s=kw.pop("timeout_s", 5), reconnect_s=0.1, **kw)


def serves(agent, secret: bytes = SECRET, **kw) -> bool:
    s = store(agent, secret, **kw)
    try:
        k = os.urandom(32)
        buf = bytearray(5)
        return s.put_many([k], [[b"hello"]]) == [True] and s.get_many([k], [[buf]]) == [True] \
            and bytes(buf) == b"hello"
    finally:
        s.close()


def nonce_exchange(agent) -> socket.socket:
    """A connection past the nonce exchange (no secret needed for that)."""
    sock = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
    sock.recv(protocol.HANDSHAKE.size)
    sock.sendall(protocol.HANDSHAKE.pack(protocol.HANDSHAKE_MAGIC, protocol.VERSION, b"n" * 16))
    return sock


def closed(sock: socket.socket, timeout: float = 0.05) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except (TimeoutError, BlockingIOError):
        return False


def raw(agent, host: str = "raw", secret: bytes = SECRET, md: bytes | None = None
        ) -> tuple[protocol.Channel, protocol.HelloReply]:
    sock = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
    ch = protocol.handshake_client(sock, secret, io_timeout=5)
    ch.send(protocol.HELLO, 1, protocol.Hello(host=host, transport="ucx" if md else "tcp",
                                              nixl_md=md))
    return ch, ch.recv().decode(protocol.HelloReply)


# ------------------------------------------------------------------ unauthenticated floods
def test_slow_unauthenticated_clients_are_cut_off_and_do_not_lock_hosts_out(agent_factory) -> None:
    a = agent_factory("--memory", "--transport", "tcp", "--io-timeout", "2", "--max-clients", "2",
                      "--max-pending", "6")
    bystander = store(a)
    assert bystander.put_many([b"B" * 32], [[b"before"]]) == [True]
    slow = [nonce_exchange(a) for _ in range(4)]
    stop = threading.Event()

    def trickle(sock: socket.socket) -> None:    # one byte of a frame header every 1.5 s
        for b in protocol.HEADER.pack(protocol.FRAME_MAGIC, protocol.VERSION, 1, 0, 1, 1, 100):
            if stop.wait(1.5):
                return
            try:
                sock.send(bytes([b]))
            except OSError:
                return

    threads = [threading.Thread(target=trickle, args=(s,), daemon=True) for s in slow]
    for t in threads:
        t.start()
    try:
        # The pending ones do not count against --max-clients 2: a second host gets in.
        assert serves(a)
        assert wait_for(lambda: all(closed(s) for s in slow), timeout=15), \
            "a client trickling bytes was not cut off at the handshake deadline"
        buf = bytearray(6)
        assert bystander.get_many([b"B" * 32], [[buf]]) == [True] and bytes(buf) == b"before"
    finally:
        stop.set()
        bystander.close()
        for s in slow:
            s.close()
    assert serves(a)


def test_flood_of_huge_claimed_frames_costs_no_memory(agent_factory) -> None:
    a = agent_factory("--memory", "--transport", "tcp", "--max-pending", "32")
    bystander = store(a)
    assert bystander.put_many([b"B" * 32], [[b"before"]]) == [True]
    before = rss(a.proc.pid)
    socks = []
    for i in range(16):
        s = nonce_exchange(a)
        s.sendall(protocol.HEADER.pack(protocol.FRAME_MAGIC, protocol.VERSION, protocol.HELLO, 0,
                                       1, 1, 60 << 20))    # a 60 MiB HELLO body, never sent
        socks.append(s)
    assert wait_for(lambda: all(closed(s) for s in socks), timeout=10), \
        "an unauthenticated 60 MiB frame was waited for"
    assert rss(a.proc.pid) - before < 64 << 20, "the agent allocated the claimed sizes"
    assert "exceeds the limit 65536" in a.text()
    assert serves(a) and bystander.exists_many([b"B" * 32]) == [True]
    bystander.close()


def test_pending_connections_beyond_the_cap_are_closed_at_accept(agent_factory) -> None:
    a = agent_factory("--memory", "--transport", "tcp", "--max-pending", "2")
    held = [nonce_exchange(a) for _ in range(2)]
    extra = socket.create_connection(("127.0.0.1", a.port), timeout=5)
    assert wait_for(lambda: closed(extra), timeout=5)
    for s in held:
        s.close()
    assert wait_for(lambda: serves(a), timeout=10)
    assert "still authenticating" in a.text()


def test_accept_out_of_descriptors_is_survived(agent_factory) -> None:
    a = agent_factory("--memory", "--transport", "tcp", "--io-timeout", "30")
    pid = a.proc.pid
    old = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    used = len(os.listdir(f"/proc/{pid}/fd"))
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (used + 2, old[1]))
    socks = [socket.create_connection(("127.0.0.1", a.port), timeout=5) for _ in range(8)]
    try:
        assert wait_for(lambda: "accept failed" in a.text(), timeout=10)
        time.sleep(0.5)
        assert a.proc.poll() is None, "EMFILE on accept killed the agent"
    finally:
        for s in socks:
            s.close()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, old)
    assert wait_for(lambda: serves(a), timeout=15)


# ------------------------------------------------------------------ authenticated but hostile
def test_descriptor_bomb_is_refused_without_decoding_it(agent_factory) -> None:
    a = agent_factory("--memory", "--transport", "tcp")
    ch, _ = raw(a)
    # 4096 blocks x 1024 descriptors (0, 0): 12 MiB of msgpack, ~400 MiB once decoded.
    block = b"\xdc\x04\x00" + b"\x92\x00\x00" * 1024
    keys = b"\xa4keys\xdc\x10\x00" + (b"\xc4\x20" + b"k" * 32) * 4096
    sizes = b"\xa5sizes\xdc\x10\x00" + b"\x00" * 4096
    descs = b"\xa5descs\xdc\x10\x00" + block * 4096
    meta = b"\x83" + keys + sizes + descs
    before = rss(a.proc.pid)
    send_meta(ch, protocol.PUT, 2, meta)
    assert closed(ch.sock, timeout=10)
    assert rss(a.proc.pid) - before < 100 << 20, "the descriptor bomb was decoded"
    assert wait_for(lambda: "meta of" in a.text())
    # Within the meta limit but over the per-request descriptor cap: refused, connection kept.
    ch, _ = raw(a)
    req = protocol.Blocks(keys=[os.urandom(32) for _ in range(40)], sizes=[0] * 40,
                          descs=[[(0, 0)] * 1000 for _ in range(40)])
    ch.send(protocol.PUT, 2, req)
    reply = ch.recv()
    assert reply.op == protocol.ERROR | protocol.REPLY
    assert "descriptors in one request" in reply.decode(protocol.ErrorReply).message
    ch.send(protocol.EXISTS, 3, protocol.KeyList([KEY]))
    assert ch.recv().decode(protocol.Flags).ok == [False]
    assert serves(a)


def test_unsafe_host_name_refused_and_not_logged(agent_factory) -> None:
    a = agent_factory("--memory", "--transport", "tcp")
    with pytest.raises((protocol.ProtocolError, EOFError, OSError)):
        raw(a, host="evil\n2099-01-01 INFO offload.agent: forged line")
    assert wait_for(lambda: "bad hello body" in a.text())
    assert "\n2099-01-01 INFO" not in a.text()
    assert serves(a)


def test_client_waits_per_request_not_per_recv(tmp_path: Path) -> None:
    """A fake agent that answers one byte every 0.3 s: the client gives up at its deadline."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    done = threading.Event()
    progress = {"sent": 0, "reply": 0}   # bytes of the reply sent so far, of its whole length

    class Collect:
        def __init__(self) -> None:
            self.data = b""

        def sendmsg(self, views):
            self.data += b"".join(bytes(v) for v in views)
            return sum(len(v) for v in views)

        def settimeout(self, t) -> None:
            pass

    def fake_agent() -> None:
        conn, _ = lsock.accept()
        ch = protocol.handshake_server(conn, SECRET, 5)
        frame = ch.recv()
        ch.send(protocol.HELLO | protocol.REPLY, frame.req_id, protocol.HelloReply(
            agent="fake", max_body=1 << 20, max_keys=4096, max_block=1 << 19, nixl=False))
        req = ch.recv(idle_timeout=10)
        out = Collect()
        ch.sock = out                                     # type: ignore[assignment]
        ch.send(protocol.EXISTS | protocol.REPLY, req.req_id, protocol.Flags([True]))
        progress["reply"] = len(out.data)
        for b in out.data:
            if done.wait(0.3):
                break
            try:
                conn.send(bytes([b]))
            except OSError:
                break
            progress["sent"] += 1
        conn.close()

    t = threading.Thread(target=fake_agent, daemon=True)
    t.start()
    s = AgentStore(f"127.0.0.1:{lsock.getsockname()[1]}", SECRET, transport="tcp", timeout_s=1)
    try:
        assert s.exists_many([KEY]) == [False]
        assert progress["sent"] < progress["reply"], "the client waited per recv, not per request"
    finally:
        done.set()
        s.close()
        lsock.close()


def test_ready_file_does_not_follow_a_planted_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    ready = tmp_path / "ready"
    (tmp_path / "ready.tmp").symlink_to(victim)         # the old predictable temp name
    env = dict(os.environ, SGLANG_OFFLOAD_SECRET=SECRET.decode(), UCX_MODULES="^ib")
    proc = subprocess.Popen([sys.executable, "-m", "offload.cli", "agent", "--listen", "127.0.0.1:0",
                             "--memory", "--transport", "tcp", "--ready-file", str(ready)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: ready.exists() and ready.read_text() != "", timeout=30)
        assert victim.read_text() == "precious"
        assert ready.read_text().isdigit() and not ready.is_symlink()
    finally:
        proc.terminate()
        proc.wait(10)


@needs_nixl
def test_another_hosts_nixl_metadata_is_refused_and_updates_release(agent_factory) -> None:
    import numpy as np

    from offload.agent import nixl_util

    a = agent_factory("--memory")
    victim = store(a, transport="ucx", name="victim")
    pool = np.zeros(1 << 20, np.uint8)
    victim.register_region(pool)
    assert victim.put_many([os.urandom(32)], [[memoryview(pool[:4096])]]) == [True]
    stolen = victim.nixl_metadata()
    assert stolen is not None
    # Another host presents the victim's metadata, at HELLO and as an update: refused.
    ch, info = raw(a, host="attacker", md=stolen)
    assert not info.nixl
    ch.send(protocol.METADATA, 2, protocol.Metadata(stolen))
    reply = ch.recv()
    assert reply.op == protocol.ERROR | protocol.REPLY
    assert "does not belong to host" in reply.decode(protocol.ErrorReply).message
    # Its own metadata, then a newer NIXL agent's: the replaced peer is released.
    mine = [nixl_util.make_agent(f"attacker/{i}") for i in range(2)]
    ch2, info2 = raw(a, host="attacker", md=mine[0].get_agent_metadata())
    assert info2.nixl
    peers = victim.stats().extra["agent_nixl_peers"]
    ch2.send(protocol.METADATA, 2, protocol.Metadata(mine[1].get_agent_metadata()))
    assert ch2.recv().op == protocol.METADATA | protocol.REPLY
    assert victim.stats().extra["agent_nixl_peers"] == peers, "the old peer was not released"
    victim.close()


# ------------------------------------------------------------------ per-host credentials
SECRETS = {"host-a": "a" * 32, "host-b": "b" * 32}
NS_A = Namespace(model="m", dtype="bf16", layout="page_first", page_size=16, salt="tenant-a")
NS_B = Namespace(model="m", dtype="bf16", layout="page_first", page_size=16, salt="tenant-b")


@pytest.fixture
def keyed(tmp_path: Path, agent_factory):
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[hosts.host-a]\nsecret = "{SECRETS["host-a"]}"\nsalts = ["tenant-a"]\n\n'
                    f'[hosts.host-b]\nsecret = "{SECRETS["host-b"]}"\nsalts = ["tenant-b"]\n')
    keys.chmod(0o600)
    return agent_factory("--memory", "--transport", "tcp", "--keys-file", str(keys))


def host(agent, name: str, secret: str | None = None) -> AgentStore:
    return store(agent, (secret or SECRETS[name]).encode(), name=name)


def test_a_host_cannot_touch_another_tenants_namespace(keyed) -> None:
    a, b = host(keyed, "host-a"), host(keyed, "host-b")
    try:
        a.register_namespace(NS_A)
        b.register_namespace(NS_B)
        ka, kb = NS_A.key("p"), NS_B.key("p")
        assert a.put_many([ka], [[b"tenant A"]]) == [True]
        assert b.put_many([kb], [[b"tenant B"]]) == [True]
        # Host A knows B's digest (keys travel unencrypted) but not B's salt.
        fake = Namespace(**{**NS_B.__dict__, "salt": "guess"})
        msg = protocol.RegisterNs(digest=NS_B.digest(), model=fake.model, dtype=fake.dtype,
                                  layout=fake.layout, page_size=fake.page_size, salted=True)
        with a._use() as (c, _):
            with pytest.raises(Exception, match="not granted"):
                c.request(protocol.REGISTER_NS, msg)
        buf = bytearray(8)
        assert a.exists_many([kb]) == [False]
        assert a.get_many([kb], [[buf]]) == [False] and bytes(buf) == bytes(8)
        assert a.delete_many([kb]) == 0
        assert a.put_many([kb], [[b"poisoned"]]) == [False]
        assert b.get_many([kb], [[buf]]) == [True] and bytes(buf) == b"tenant B"
        assert a.exists_many([ka]) == [True]
    finally:
        a.close()
        b.close()


def test_a_host_cannot_act_as_another(keyed) -> None:
    # Host A's secret under host B's name, an unknown name, the shared secret: all refused.
    for name, secret in (("host-b", SECRETS["host-a"]), ("host-c", SECRETS["host-a"]),
                         ("host-b", SECRET.decode())):
        s = host(keyed, name, secret)
        assert s.put_many([NS_B.key("x")], [[b"x"]]) == [False]
        s.close()
    b = host(keyed, "host-b")
    b.register_namespace(NS_B)
    assert b.exists_many([NS_B.key("x")]) == [False]
    assert b.stats().extra["agent_rejected_auth"] == 3
    b.close()
    assert "unauthenticated" in keyed.text()       # (repeats within seconds are counted, not logged)


def test_register_ns_does_not_send_the_salt(keyed) -> None:
    a = host(keyed, "host-a")
    try:
        with recording_sends() as sent:
            a.register_namespace(NS_A)
            assert a.put_many([NS_A.key("p")], [[b"x"]]) == [True]
    finally:
        a.close()
    assert sent and not any(b"tenant-a" in s for s in sent)
