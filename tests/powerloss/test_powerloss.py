"""Power loss, not just kill -9: every page acknowledged before a power cut reads back exactly after it.

The cache directory lives on `lazyfs.py`, a FUSE file system that keeps whatever was not fsync'ed (data)
or whose directory was not fsync'ed (names) only in memory. A writer process stores pages and prints
each acknowledged one; at a random moment the file system process is SIGKILLed (the power cut), then
the writer; the backing directory is remounted and the next round's writer first reads back every
page acknowledged so far. Writers: the `DiskStore` itself, SGLang's HiCache interface (our
`OffloadStorage` built by SGLang's own factory over a real host KV pool), and the agent's store (an
agent process on the file system under test, a client storing through it). Plus the index-rebuild
path: after each cut the SQLite index is destroyed, so each reopen rebuilds it from the slab headers.
Some runs add lazyfs's random early writeback (`writeback=`): any subset of the unsynced changes
may then survive the cut, not only none of them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.powerloss.harness import Rounds, Writer, lazyfs_unavailable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(bool(lazyfs_unavailable()), reason=lazyfs_unavailable() or "-")]


def _check(rounds: Rounds, min_acked: int = 20) -> None:
    print(rounds.report())
    assert len(rounds.acked) >= min_acked, (
        f"only {len(rounds.acked)} pages acknowledged in {rounds.rounds - 1} rounds: the writer did "
        "not get to write (see the writer's stderr / lazyfs.log)")
    assert not rounds.lost(), rounds.report()


def test_disk_store_survives_power_cuts(tmp_path: Path) -> None:
    # O_DIRECT on: the store's direct I/O path (not its buffered fallback) is what runs on lazyfs.
    _check(Rounds(tmp_path, "disk", seed=14, start_writer=lambda o: Writer({**o, "o_direct": "on"}))
           .run(cuts=5))


def _destroy_index(backing: Path) -> None:
    """What an operator's `rm index.db` or a torn index leaves: garbage where the index was."""
    for suffix in ("-wal", "-shm"):
        (backing / f"index.db{suffix}").unlink(missing_ok=True)
    (backing / "index.db").write_bytes(b"not a database " * 512)


def test_index_rebuild_after_power_cuts(tmp_path: Path) -> None:
    rounds = Rounds(tmp_path, "disk", seed=3, damage=_destroy_index, writeback=0.05).run(cuts=4)
    _check(rounds)
    assert list(rounds.backing.glob("index.db.damaged-*")), "the index was never rebuilt"


def test_sglang_interface_survives_power_cuts(tmp_path: Path) -> None:
    # Each round starts SGLang's host pool and our backend afresh (seconds): few rounds.
    _check(Rounds(tmp_path, "sglang", seed=5, verify_timeout=180).run(cuts=2), min_acked=8)


def test_agent_store_survives_power_cuts(tmp_path: Path) -> None:
    from tests.agent.conftest import SECRET, AgentProc

    agents: list[AgentProc] = []

    def start(opts: dict) -> Writer:
        agent = AgentProc(tmp_path, ["--store", opts["dir"], "--transport", "tcp",
                                     "--capacity", "1GiB"])
        agents.append(agent)
        agent.start(timeout=60)
        env = dict(os.environ, SGLANG_OFFLOAD_SECRET=SECRET.decode())
        return Writer({**opts, "address": agent.address}, env=env)

    def stop() -> None:
        for a in agents:
            a.kill()
            a.stop()
        agents.clear()

    _check(Rounds(tmp_path, "agent", seed=9, start_writer=start, stop_extra=stop, writeback=0.05)
           .run(cuts=3))
