"""Issue 36, red team: a tenant spends only its own budgets (the metadata checker, the rate
buckets, the log lines, the feed book), on one real agent process, NIXL over UCX on loopback.

Each attack below got through on 694c69d:
1. stale NIXL metadata (agents that have exited) held the agent's one metadata checker ~10 s
   each (UCX wrote "connect failed" into the checker's reply pipe), under a lock every tenant
   shares: another tenant's new connections timed out;
4. announcing pages in batches led by the same page detached the tenant's book: past the cap of
   100,000 pages, counted nowhere;
6. a refused challenge still created a rate bucket: junk pushed the victim endpoint's bucket out
   and it came back full (96 nonces in 20 s against 16 + 1/s);
7. every refused request wrote a WARNING line (20,000 refused EXISTS: 20,000 lines).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from offload.agent import protocol
from offload.agent.feed import PER_TENANT
from offload.agent.rate import ENDPOINT_RATE, KEY_RATE, PER_ENDPOINT
from offload.keys import Namespace
from tests.agent.conftest import needs_nixl, wait_for
from tests.agent.tenants import COUNTER, NS, SECRETS, Raw, host, keys_file, renamed

pytestmark = pytest.mark.slow

PAGE = 4096
STALE = """
import sys
from offload.agent import nixl_util
agents = [nixl_util.make_agent(f"{sys.argv[1]}/stale-{i}") for i in range(int(sys.argv[2]))]
for a in agents:
    print(a.get_agent_metadata().hex(), flush=True)
"""


def stale_metadata(name: str, n: int) -> list[bytes]:
    """Metadata of `n` NIXL agents of a process that has exited (their endpoints are gone)."""
    out = subprocess.run([sys.executable, "-c", STALE, name, str(n)], capture_output=True,
                         text=True, env=dict(os.environ), timeout=120, check=True)
    return [bytes.fromhex(line) for line in out.stdout.split()]


def patient(agent, name: str, md: bytes | None = None) -> Raw:
    raw = Raw(agent, name, md)
    raw.ch.io_timeout = 120.0       # its requests may be slow: the victim's are what is measured
    return raw


@needs_nixl
def test_stale_metadata_of_one_tenant_never_locks_another_out_of_new_connections(
        tmp_path: Path, agent_factory) -> None:
    agent = agent_factory("--memory", "--keys-file", str(keys_file(tmp_path, SECRETS)))
    stale = stale_metadata("attacker", 8)
    pool = np.frombuffer(os.urandom(4 * PAGE), np.uint8).copy()
    warm = host(agent, "victim", connections=1, timeout_s=60)    # the checkers have started
    try:
        warm.register_region(pool)
        assert warm.put_many([NS["victim"].key("warm")], [[memoryview(pool[:PAGE])]]) == [True]
    finally:
        warm.close()
    attacker = patient(agent, "attacker")
    for i, md in enumerate(stale):               # pipelined: the agent checks them one by one
        attacker.ch.send(protocol.METADATA, 100 + i, protocol.Metadata(md))
    served = []
    for i in range(4):                           # new connections: a restart, a new rank
        victim = host(agent, "victim", connections=1)
        try:
            victim.register_region(pool)
            k = NS["victim"].key(f"new-{i}")
            blk = memoryview(pool[i * PAGE:(i + 1) * PAGE])
            served.append(victim.put_many([k], [[blk]]) == [True] and victim._conns[0].nixl)
        finally:
            victim.close()
    assert served == [True] * 4, f"the victim's new NIXL connections: {served}"
    replies = [attacker.ch.recv() for _ in stale]
    assert all(f.op == protocol.ERROR | protocol.REPLY for f in replies)
    stats = attacker.call(protocol.STATS, protocol.Empty())[0]
    assert isinstance(stats, protocol.StatsReply)
    assert stats.fields["agent_checker_seconds_key"] > 0        # charged to its own key


@needs_nixl
def test_checker_time_is_charged_to_the_key_that_spends_it() -> None:
    """A key whose metadata keeps the checker past its deadline spends its own checker time and
    is refused; another key is not (the pool and the budget of `offload.agent.vet.Vetter`)."""
    from offload.agent.vet import Vetter

    v = Vetter(timeout_s=1e-4, budget_s=3e-4, rate_s=1e-9)   # every check overruns its deadline
    v.start()
    try:
        stale = stale_metadata("attacker", 4)
        answers = [v.vet(md, "attacker") for md in stale]
        assert all(a is not None and "spent its NIXL metadata checker time" not in a
                   for a in answers[:3]), answers
        assert "spent its NIXL metadata checker time" in (answers[3] or "")
        assert v.left("attacker") < 1e-4
        other = v.vet(stale_metadata("victim", 1)[0], "victim")
        assert other is not None and "spent" not in other      # checked (and timed out), its own
    finally:
        v.close()


def test_reannouncing_a_page_never_resets_a_tenants_count(agent_factory, tmp_path: Path) -> None:
    agent = agent_factory("--memory", "--transport", "tcp", "--memory-reserve", "1MiB",
                          "--keys-file", str(keys_file(tmp_path, SECRETS)))
    attacker = patient(agent, "attacker")
    ns: Namespace = NS["attacker"]
    batch = protocol.MAX_KEYS - 1
    total = PER_TENANT + 4 * batch
    keys = [ns.key(f"p{i}") for i in range(total + 1)]
    for i in range(0, len(keys), protocol.MAX_KEYS):
        part = keys[i:i + protocol.MAX_KEYS]
        reply = attacker.call(protocol.PUT, protocol.Blocks(part, [1] * len(part)),
                              [memoryview(b"x" * len(part))])[0]
        assert isinstance(reply, protocol.Flags) and all(reply.ok)
    lead = (keys[0], 0, None)
    assert attacker.call(protocol.ANNOUNCE, protocol.Announce([lead]))[0] == protocol.Flags([True])
    for i in range(1, total + 1, batch):         # each batch led by the same page
        pages = [lead] + [(k, i + j, None) for j, k in enumerate(keys[i:i + batch])]
        reply = attacker.call(protocol.ANNOUNCE, protocol.Announce(pages))[0]
        assert isinstance(reply, protocol.Flags) and all(reply.ok)
    stats = attacker.call(protocol.STATS, protocol.Empty())[0]
    assert isinstance(stats, protocol.StatsReply)
    assert stats.fields["agent_feed_pages"] <= PER_TENANT, stats.fields["agent_feed_pages"]


@needs_nixl
def test_junk_challenges_never_give_a_victims_endpoint_bucket_back_full(
        tmp_path: Path, agent_factory) -> None:
    """The attacker replays the victim's metadata under its own name until its (key, endpoint)
    bucket is empty, then floods METADATA naming other endpoints (refused: its key's bucket is
    empty too), then replays again: the victim's endpoint receives at most 16 + 1/s."""
    agent = agent_factory("--memory", "--keys-file", str(keys_file(tmp_path, SECRETS)))
    child = subprocess.Popen([sys.executable, "-c", COUNTER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=dict(os.environ), text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        md = renamed(bytes.fromhex(child.stdout.readline().strip()), "attacker")
        raw = patient(agent, "attacker")
        start = time.monotonic()
        for r in range(ROUNDS):
            _pipelined(raw, [md] * (2 * PER_ENDPOINT))
            # Junk: the victim's metadata with another worker address each time (refused once
            # the key's own bucket is empty; before, each refusal created a bucket).
            _pipelined(raw, [_other_endpoint(md, r * JUNK + j) for j in range(JUNK)])
            time.sleep(2 * PER_ENDPOINT / KEY_RATE)   # the key's own bucket refills meanwhile
        _pipelined(raw, [md] * (2 * PER_ENDPOINT))
        elapsed = time.monotonic() - start
        child.stdin.close()
        received = int(child.stdout.readline())
        allowed = PER_ENDPOINT + ENDPOINT_RATE * elapsed + 2
        assert received <= allowed, f"{received} nonces in {elapsed:.0f}s (at most {allowed:.0f})"
    finally:
        child.kill()
        child.wait(10)


ROUNDS = 5
JUNK = 4200          # more than the 4096 buckets the agent kept in all before


def _pipelined(raw: Raw, mds: list[bytes], window: int = 256) -> None:
    """METADATA for each of `mds`, `window` requests in flight at a time."""
    for i in range(0, len(mds), window):
        part = mds[i:i + window]
        for md in part:
            raw.req += 1
            raw.ch.send(protocol.METADATA, raw.req, protocol.Metadata(md))
        for _ in part:
            raw.ch.recv()


def _other_endpoint(md: bytes, j: int) -> bytes:
    """`md` whose UCX worker address differs in its last 4 bytes (another endpoint), and is of
    a version UCX does not unpack: refused by the rate buckets, or when granted a token by the
    agent's own check (`vet.check_metadata`), never loaded."""
    from offload.agent.vet import _UCX_CONN

    i = md.index(_UCX_CONN) + len(_UCX_CONN)
    n = int.from_bytes(md[i:i + 8], "little")
    start, end = i + 8, i + 8 + n
    return (md[:start] + bytes([md[start] | 0x0F]) + md[start + 1:end - 4]
            + j.to_bytes(4, "little") + md[end:])


def test_refused_requests_write_a_handful_of_log_lines(tmp_path: Path, agent_factory) -> None:
    agent = agent_factory("--memory", "--transport", "tcp",
                          "--keys-file", str(keys_file(tmp_path, SECRETS)))
    attacker = patient(agent, "attacker")
    victim = host(agent, "victim", transport="tcp")
    theirs = [NS["victim"].key("v0")]
    try:
        assert victim.put_many(theirs, [[b"v"]]) == [True]
        before = len(agent.text().splitlines())
        start = time.monotonic()
        n = 20_000
        for _ in range(n):
            reply = attacker.call(protocol.EXISTS, protocol.KeyList(theirs))[0]
            assert isinstance(reply, protocol.ErrorReply)
        elapsed = time.monotonic() - start
        # The victim's own refusal is still logged (its own budget of lines).
        reply = patient(agent, "victim").call(protocol.EXISTS, protocol.KeyList(
            [NS["attacker"].key("a0")]))[0]
        assert isinstance(reply, protocol.ErrorReply)
        assert wait_for(lambda: "host victim" in agent.text().split("\n", before)[-1])
        lines = [ln for ln in agent.text().splitlines()[before:] if "WARNING" in ln]
        attacker_lines = [ln for ln in lines if re.search(r"\bhost attacker\b", ln)]
        allowed = 2 + elapsed / 5.0
        assert len(attacker_lines) <= allowed, \
            f"{len(attacker_lines)} lines for {n} refused requests in {elapsed:.0f}s"
        assert any("more like it" in ln for ln in attacker_lines[1:]) or len(attacker_lines) == 1
    finally:
        victim.close()


def test_a_tenant_flooding_one_kind_leaves_other_tenants_lines() -> None:
    """The log limit is per (kind, host key): one tenant's flood never silences another's."""
    import logging

    from offload.agent.server import AgentServer
    from offload.store.memory.store import MemoryStore

    srv = AgentServer(MemoryStore(1 << 20), b"s" * 32, transport="tcp")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    log = logging.getLogger("offload.agent")
    handler = Keep()
    log.addHandler(handler)
    try:
        for _ in range(1000):
            srv.warn("refused-exists", "attacker", "attacker refused")
        srv.warn("refused-exists", "victim", "victim refused")
    finally:
        log.removeHandler(handler)
    assert seen == ["attacker refused", "victim refused"]
