"""Red team of the agent's split (protocol, client, session into parts): every message type walked
through the new modules for a bound or check skipped on some path.

A GET whose keys and sizes disagree is refused by `put_get.PutGet.check` (an ERROR reply, the
connection kept). But when one of its keys is acknowledged and not yet durable (hidden, `acks`),
`PutGet.get` first builds the request of the visible keys by index into `sizes`, before any
check: the agent raised IndexError, logged an internal error and closed the connection (same
before the split, session.py's `_get`; kept by it). Fixed in `put_get.PutGet.get`, which checks
the lengths first. Real agent process, real disk store; the key
stays hidden because this test holds the store's SQLite index (BEGIN EXCLUSIVE), as another
process may, so the commit waits.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from offload.agent import protocol
from tests.agent.conftest import wait_for
from tests.agent.tenants import NS, SECRETS, Raw, keys_file

pytestmark = pytest.mark.slow

SIZE = 4096


def test_a_get_with_a_hidden_key_and_too_few_sizes_is_refused(tmp_path: Path, agent_factory):
    store = tmp_path / "store"
    agent = agent_factory("--store", str(store), "--transport", "tcp", "--capacity", "1GiB",
                          "--keys-file", str(keys_file(tmp_path, SECRETS)))
    raw = Raw(agent, "attacker", None)
    ns = NS["attacker"]
    k0, k1, k2 = ns.key("first"), ns.key("hidden"), ns.key("other")
    page = memoryview(bytes(SIZE))
    # a first put reserves this agent's range of slots and commits
    assert raw.call(protocol.PUT, protocol.Blocks(keys=[k0], sizes=[SIZE]), [page])[0].ok == [True]
    assert wait_for(lambda: raw.call(protocol.DURABLE, protocol.Durable([k0], budget_ms=100))[0]
                    .ok == [True])
    db = sqlite3.connect(store / "index.db", timeout=1, isolation_level=None)
    try:
        db.execute("BEGIN EXCLUSIVE")   # the commit of the next put waits: its key stays hidden
        assert raw.call(protocol.PUT, protocol.Blocks(keys=[k1], sizes=[SIZE]),
                        [page])[0].ok == [True]
        assert raw.call(protocol.DURABLE, protocol.Durable([k1], budget_ms=50))[0].ok == [False]
        reply, _ = raw.call(protocol.GET, protocol.Blocks(keys=[k1, k2], sizes=[SIZE],
                                                          budget_ms=50))
        assert isinstance(reply, protocol.ErrorReply), reply
        assert "sizes" in reply.message
    finally:
        db.execute("ROLLBACK")
        db.close()
