"""The index rebuild as a transaction: killed or failing at any step it leaves the old index or the
complete new one; an empty, zero-length or incomplete index beside slab files is rebuilt, never
trusted; stray slab names and hostile header values are skipped and counted. Real files; the kills
are real SIGKILLs of a subprocess at each step (`recovery.step`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from offload.store.base import get_bytes
from offload.store.disk import recovery
from offload.store.disk.index.db import Index
from offload.store.disk.slab import format as slot_format
from tests.store.blocks import data, key
from tests.store.stores import damage_index as damage
from tests.store.stores import open_store

pytestmark = pytest.mark.slow

SIZE = 16 << 10
SLOT = slot_format.slot_bytes_for(SIZE)
N = 24
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
STEPS = ["start", "created", "filled", "synced", "set aside", "renamed"]

KILLER = """
import os, signal, sys
sys.path.insert(0, sys.argv[3])
from offload.store.disk import recovery
from tests.store.stores import open_store
def step(name):
    if name == sys.argv[2]:
        os.kill(os.getpid(), signal.SIGKILL)
recovery.step = step
open_store(sys.argv[1]).close()
"""


def put(s, ids, size=SIZE) -> list[bool]:
    ks = [key(i) for i in ids]
    return s.put_many(ks, [[data(k, size)] for k in ks])


def present(d, n=N) -> int:
    """How many of blocks 0..n-1 read back byte-exact (none may read back wrong)."""
    with open_store(d) as s:
        got = [get_bytes(s, key(i), SIZE) for i in range(n)]
    assert all(g is None or g == data(key(i), SIZE) for i, g in enumerate(got))
    return sum(g is not None for g in got)


def filled(d) -> None:
    with open_store(d) as s:
        assert put(s, range(N)) == [True] * N


def drop_index(d) -> None:
    for name in ("index.db", "index.db-wal", "index.db-shm"):
        if os.path.lexists(d / name):
            os.unlink(d / name)


@pytest.mark.parametrize("at", STEPS)
def test_sigkill_at_each_rebuild_step_loses_nothing(tmp_path, at):
    d = tmp_path / "cache"
    filled(d)
    damage(d)
    p = subprocess.run([sys.executable, "-c", KILLER, str(d), at, ROOT], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert present(d) == N                       # the next open finishes the job
    assert not os.path.exists(d / ("index.db" + recovery.REBUILD_SUFFIX))
    assert present(d) == N                       # and what it left is a sound index


@pytest.mark.parametrize("at", STEPS)
def test_failure_at_each_rebuild_step_loses_nothing(tmp_path, monkeypatch, at):
    d = tmp_path / "cache"
    filled(d)
    os.unlink(d / "index.db")                    # a missing index: rebuilt

    def fail(name: str) -> None:
        if name == at:
            raise OSError(5, f"injected failure at {name}")

    monkeypatch.setattr(recovery, "step", fail)
    with pytest.raises(Exception, match="injected"):
        open_store(d)
    monkeypatch.setattr(recovery, "step", lambda name: None)
    assert present(d) == N


def test_zero_length_index_beside_slabs_is_rebuilt_and_no_slab_deleted(tmp_path):
    d = tmp_path / "cache"
    filled(d)
    for name in ("index.db", "index.db-wal", "index.db-shm"):
        if os.path.exists(d / name):
            os.truncate(d / name, 0)
    with open_store(d) as s:
        assert s.rebuilt_from and ".empty-" in s.rebuilt_from
        assert put(s, range(N, N + 8)) == [True] * 8   # the same block size: no slab replaced
    assert present(d, N + 8) == N + 8


def test_empty_index_beside_slabs_is_rebuilt(tmp_path):
    """What a rebuild killed halfway left before: a valid index that names nothing."""
    d = tmp_path / "cache"
    filled(d)
    drop_index(d)
    ix = Index(str(d / "index.db"))
    ix.check_and_init()
    ix.close()
    with open_store(d) as s:
        assert s.rebuilt_from and ".incomplete-" in s.rebuilt_from
        assert put(s, range(N, N + 8)) == [True] * 8
    assert present(d, N + 8) == N + 8


def test_a_slab_with_data_that_no_segment_names_is_never_deleted(tmp_path, monkeypatch):
    """Even with the open-time check bypassed, creating a segment never deletes a slab's data."""
    d = tmp_path / "cache"
    filled(d)
    (name,) = [n for n in os.listdir(d) if n.endswith(".slab")]
    before = (d / name).read_bytes()
    drop_index(d)
    monkeypatch.setattr(recovery, "scan_slabs", lambda directory: recovery.Scan())
    with open_store(d) as s:
        assert put(s, [100]) == [True]
    kept = [n for n in os.listdir(d) if n.startswith(name + ".orphan-")]
    assert len(kept) == 1 and (d / kept[0]).read_bytes() == before


def test_stray_slab_names_are_skipped_and_counted(tmp_path, caplog):
    d = tmp_path / "cache"
    filled(d)
    stray = ["seg-000009-0.slab", f"seg-{'1' * 23}-{SLOT}.slab", f"seg-7-{SLOT}.slab",
             f"seg-000008-{SLOT + 1}.slab", "seg-000010-4096.slab.tmp", "seg-x-8192.slab",
             f"seg-{'٣' * 6}-{SLOT}.slab"]
    for n in stray:
        (d / n).write_bytes(b"\xff" * 8192)
    os.mkdir(d / f"seg-000011-{SLOT}.slab")
    damage(d)
    with open_store(d) as s:
        assert s.rebuilt_from
        assert put(s, range(N, N + 4)) == [True] * 4
    assert "7 slab files and names skipped" in caplog.text
    assert present(d, N + 4) == N + 4
    assert all(os.path.exists(d / n) for n in stray)   # skipped, not deleted


def test_hostile_slab_headers_and_sizes_are_skipped(tmp_path, caplog):
    d = tmp_path / "cache"
    filled(d)
    (name,) = [n for n in os.listdir(d) if n.endswith(".slab")]
    with open(d / name, "r+b") as f:       # block 3's header, well formed, claims 2**42 bytes
        f.seek(3 * SLOT)
        f.write(slot_format.pack_header(key(3), 1 << 42, 0, 0))
        f.seek(5 * SLOT)                     # block 5's: a length of another size class
        f.write(slot_format.pack_header(key(5), SIZE * 4, 0, 0))
    huge = d / slot_format.segment_name(40, SLOT)
    with open(huge, "wb") as f:              # a sparse slab claiming 1 TiB
        f.truncate(1 << 40)
    damage(d)
    with open_store(d) as s:
        got = s.exists_many([key(i) for i in range(N)])
    assert got == [i not in (3, 5) for i in range(N)]
    assert "slab files and names skipped" in caplog.text
    assert present(d) == N - 2
