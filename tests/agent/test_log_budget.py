"""Issue 36 round 2, red team: every line the agent logs on a peer's input is the peer's budget
(`AgentServer.say`: at most once per 5 s per kind and host key, with the count of the others).

On 29ab695 each authenticated connection wrote an INFO "host ... connected" line, and one that
the peer reset an INFO "connection ... ended" line: a tenant reconnecting in a loop (what a
flapping host, or a hostile one, does) wrote two lines per connection, unbounded (like the 20,000
refused EXISTS of issue 36 item 7).
"""

from __future__ import annotations

import re
import socket
import struct
import time
from pathlib import Path

from offload.agent import protocol
from tests.agent.conftest import wait_for
from tests.agent.tenants import SECRETS, Raw, keys_file

CHURN = 400


def _connect_and_reset(port: int, name: str) -> None:
    """One authenticated connection (HELLO answered), then reset by the peer (RST)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    ch = protocol.handshake_client(sock, SECRETS[name].encode(), io_timeout=30)
    ch.send(protocol.HELLO, 1, protocol.Hello(host=name, transport="tcp"))
    assert ch.recv().op == protocol.HELLO | protocol.REPLY
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_reconnect_churn_writes_a_handful_of_log_lines(tmp_path: Path, agent_factory) -> None:
    agent = agent_factory("--memory", "--transport", "tcp",
                          "--keys-file", str(keys_file(tmp_path, SECRETS)))
    before = len(agent.text().splitlines())
    start = time.monotonic()
    for _ in range(CHURN):
        _connect_and_reset(agent.port, "attacker")
    elapsed = time.monotonic() - start
    # The victim's own connection is still logged (its own budget of lines); once the agent
    # counts no connection of the attacker's, every line they made is in the file.
    victim = Raw(agent, "victim", None)

    def attacker_gone() -> bool:
        reply = victim.call(protocol.STATS, protocol.Empty())[0]
        assert isinstance(reply, protocol.StatsReply)
        return reply.fields["agent_quota_tenants"] == 1
    assert wait_for(attacker_gone, 60)
    assert wait_for(lambda: re.search(r"\bhost victim connected", agent.text()) is not None, 30)
    lines = [ln for ln in agent.text().splitlines()[before:]
             if re.search(r"\bhost attacker\b", ln)]
    allowed = 2 * (2 + elapsed / 5.0)           # two kinds: connected, ended
    assert len(lines) <= allowed, \
        f"{len(lines)} log lines for {CHURN} connections in {elapsed:.0f}s: {lines[:4]}"
    victim.ch.sock.close()
