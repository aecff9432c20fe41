"""Slots of deleted blocks held until they are punched (issue 36, items 3 and 9, round 3).

A committed block's slot is punched only after the transaction deleting its row commits; until
then the deleting process holds it in `reserved`. That row must read the same to every process
that may share the directory, this version or the previous one (694c69d, which judges an owner
by its locked `lease-<32 hex>` file and, reclaiming a dead owner, gives its slots back and takes
their bytes off `used`). A hold once owned by `punch:<lease>` was judged dead at once by the
previous version: it reclaimed the holds of a live writer (their slots handed out before the
holder punched them) and took bytes never counted off `used` (-278,528 where 278,528 were
stored: the shared cap gone). The invariant, on real files and processes: every `reserved` row
is owned by a token whose lease file a live process holds locked, and `used` counts every slot
that is not free (blocks and `reserved` rows) -- while the holder lives, after another process
opens the directory, and after the holder is SIGKILLed between its delete and its next write."""

from __future__ import annotations

import fcntl
import os
import signal
import sqlite3
import struct
import subprocess
import sys

import pytest

from tests.store.sharers import ENV, SIZE

pytestmark = pytest.mark.slow

_FLOCK = struct.Struct("hhxxxxqqi4x")
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_HEX = set("0123456789abcdef")

# A writer in a process of its own: fills a 1 MiB store past its cap (evictions), deletes its last
# batch (its last write transaction frees committed slots: held, not yet given back), says so and
# waits on stdin (then closes) or for a SIGKILL.
_HOLDER = """
import sys
from offload.config import Size, StoreConfig
from offload.store.disk.store import DiskStore
from tests.store.blocks import data, key
SIZE = int(sys.argv[2])
s = DiskStore(StoreConfig(path=sys.argv[1], capacity=Size(1 << 20), min_free=Size(0),
                          segment_size=Size(512 << 10), io_threads=2))
for b in range(6):
    ks = [key(b * 8 + j) for j in range(8)]
    s.put_many(ks, [[data(k, SIZE)] for k in ks])
    assert s.flush(60)
s.delete_many([key(40 + j) for j in range(8)])
print("held", flush=True)
sys.stdin.readline()
s.close()
"""

_OPEN = """
import sys
from offload.config import Size, StoreConfig
from offload.store.disk.store import DiskStore
DiskStore(StoreConfig(path=sys.argv[1], capacity=Size(1 << 20), min_free=Size(0),
                      segment_size=Size(512 << 10), io_threads=2)).close()
"""


def _previous_version_alive(d, owner: str) -> bool:
    """How the previous version judges an owner: a `lease:<32 hex>` token whose lease file is
    locked; any other token (not of its boot id : pid form) is dead at once."""
    name = owner.removeprefix("lease:")
    if not owner.startswith("lease:") or len(name) != 32 or set(name) - _HEX:
        return False
    try:
        fd = os.open(os.path.join(d, "lease-" + name), os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        got = fcntl.fcntl(fd, _F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
        return _FLOCK.unpack(got)[0] != fcntl.F_UNLCK
    finally:
        os.close(fd)


def _accounts(d) -> tuple[int, int, dict[str, int]]:
    """(meta used, bytes of every slot not free, reserved bytes per owner)."""
    db = sqlite3.connect(f"file:{d}/index.db?mode=ro", uri=True)
    try:
        used = db.execute("SELECT value FROM meta WHERE name='used'").fetchone()[0]
        blocks = db.execute("SELECT coalesce(sum(slot_bytes), 0) FROM blocks").fetchone()[0]
        held = dict(db.execute("SELECT owner, sum(slot_bytes) FROM reserved GROUP BY owner"))
    finally:
        db.close()
    return used, blocks + sum(held.values()), held


def _run(script: str, d) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, str(d), str(SIZE)], env=ENV, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def _open_elsewhere(d) -> None:
    p = _run(_OPEN, d)
    p.communicate(timeout=300)
    assert p.returncode == 0


def _holding(d) -> subprocess.Popen:
    p = _run(_HOLDER, d)
    assert p.stdout is not None and p.stdout.readline().strip() == "held", p.poll()
    return p


def test_held_slots_are_owned_and_counted_as_every_version_reads_them(tmp_path):
    d = tmp_path / "cache"
    p = _holding(d)
    try:
        used, counted, held = _accounts(d)
        assert held, "the deleter holds the slots it freed until its next write"
        assert used == counted, (used, counted, held)
        for owner in held:   # what the previous version, sharing the directory, would judge
            assert _previous_version_alive(d, owner), f"{owner} reclaimed beside its live holder"
        _open_elsewhere(d)   # another process's open reclaims dead owners: not this one
        assert _accounts(d) == (used, counted, held)
        p.communicate("\n", timeout=300)
        assert p.returncode == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    _open_elsewhere(d)
    used, counted, held = _accounts(d)
    assert used == counted and not held, (used, counted, held)


def test_a_holder_killed_before_giving_its_slots_back_leaks_nothing(tmp_path):
    d = tmp_path / "cache"
    p = _holding(d)
    before = _accounts(d)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL
    _open_elsewhere(d)   # reclaims the dead holder's slots: punched, free, off `used`
    used, counted, held = _accounts(d)
    assert used == counted and not held, (used, counted, held, before)
    assert used == before[1] - sum(before[2].values())   # the blocks' slots, nothing else
