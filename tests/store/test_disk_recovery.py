"""The disk store after losing files: a missing slab is dropped (not a poisoned block size), a
deleted block stays deleted through an index rebuild even without hole punching, new slab names are
fsync'ed into the directory, and the slab fd cache stays bounded. Real files."""

from __future__ import annotations

import os
import threading

from offload.store.base import get_bytes
from offload.store.disk import cachedir
from offload.store.disk.slab import files as slab
from offload.store.disk.slab import format as slot_format
from tests.store.blocks import data, key
from tests.store.stores import damage_index, open_store

SIZE = 64 << 10
SLOT = slot_format.slot_bytes_for(SIZE)


def put(s, ids, size=SIZE) -> list[bool]:
    ks = [key(i) for i in ids]
    return s.put_many(ks, [[data(k, size)] for k in ks])


def slabs_of(d, slot_bytes=SLOT) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.endswith(f"-{slot_bytes}.slab"))


def exact(s, ids, size=SIZE) -> bool:
    return all(get_bytes(s, key(i), size) == data(key(i), size) for i in ids)


# ---- a missing slab ----------------------------------------------------------------------------

def test_slab_missing_at_open_is_dropped_and_its_size_stays_usable(tmp_path):
    d = tmp_path / "cache"
    with open_store(d) as s:
        assert put(s, range(4)) == [True] * 4
        assert put(s, [100], size=1 << 20) == [True]
        st = s.stats()
        used = st.bytes_used                          # stored (the range ahead apart)
    (name,) = slabs_of(d)
    os.unlink(d / name)  # what a power cut does to a slab whose name was never made durable
    with open_store(d) as s:
        assert s.exists_many([key(i) for i in range(4)]) == [False] * 4
        assert s.exists_many([key(100)]) == [True] and exact(s, [100], 1 << 20)
        assert s.stats().bytes_used == used - 4 * SLOT
        assert put(s, range(4)) == [True] * 4  # the same size: a new slab, not the lost slots
        assert exact(s, range(4))
        assert name not in slabs_of(d)          # a dropped segment's id is never handed out again


def test_slab_deleted_while_open_is_dropped_on_the_first_read(tmp_path):
    d = tmp_path / "cache"
    with open_store(d) as a:
        assert put(a, range(4)) == [True] * 4
        a.flush()
        (name,) = slabs_of(d)
        os.unlink(d / name)
        with open_store(d) as b:             # a process that has no fd of the lost slab
            assert get_bytes(b, key(0), SIZE) is None
            assert b.exists_many([key(i) for i in range(4)]) == [False] * 4
            assert a.exists_many([key(i) for i in range(4)]) == [False] * 4  # every process
            assert put(b, range(4, 8)) == [True] * 4
            assert put(a, range(8, 12)) == [True] * 4
            assert a.flush() and b.flush()       # each sees the other's blocks once committed
            assert exact(a, range(4, 12)) and exact(b, range(4, 12))


def test_slab_deleted_under_an_open_fd_is_not_written_into(tmp_path):
    """A put checks the slab of its reserved slots still has a link (`fstat` of the open fd):
    a deleted one is dropped, and the blocks go to a new slab."""
    d = tmp_path / "cache"
    with open_store(d) as s:
        assert put(s, range(2)) == [True] * 2
        s.flush()
        os.unlink(d / slabs_of(d)[0])
        assert put(s, [2, 3]) == [True, True] and s.flush()
        assert s.exists_many([key(i) for i in range(4)]) == [False, False, True, True]
        assert put(s, range(2)) == [True] * 2
        assert exact(s, range(4))


def test_slab_deleted_between_the_write_and_the_sync_fails_the_put_then_recovers(tmp_path):
    """Blocks written into a slab unlinked before its fdatasync would be made visible and lost:
    the sync sees it (the put returned once written; the blocks then never appear)."""
    d = tmp_path / "cache"
    with open_store(d) as s:
        assert put(s, range(2)) == [True] * 2
        s.flush()
        real = s._commits._sync

        def unlink_then_sync(segs):  # type: ignore[no-untyped-def]
            for name in slabs_of(d):
                os.unlink(d / name)
            return real(segs)

        s._commits._sync = unlink_then_sync
        assert put(s, [2, 3]) == [True, True]
        assert s.flush() is False                      # lost: counted, never visible
        s._commits._sync = real
        assert s.exists_many([key(i) for i in range(4)]) == [False] * 4
        assert put(s, range(4)) == [True] * 4
        assert exact(s, range(4))


def test_truncated_slab_is_a_miss_and_dropped(tmp_path):
    d = tmp_path / "cache"
    with open_store(d) as s:
        assert put(s, range(4)) == [True] * 4
    (name,) = slabs_of(d)
    os.truncate(d / name, 2 * SLOT + 100)
    with open_store(d) as s:
        assert exact(s, [0, 1])
        assert get_bytes(s, key(2), SIZE) is None and get_bytes(s, key(3), SIZE) is None
        assert s.exists_many([key(i) for i in range(4)]) == [True, True, False, False]
        assert put(s, [2, 3]) == [True, True] and exact(s, range(4))


# ---- deleted blocks through a rebuild -----------------------------------------------------------


def test_rebuild_does_not_resurrect_deleted_blocks_without_hole_punching(tmp_path, monkeypatch):
    monkeypatch.setattr(slab, "punch_hole", lambda fd, off, n: False)  # e.g. a file system without
    d = tmp_path / "cache"
    with open_store(d) as s:
        assert put(s, range(6)) == [True] * 6
        assert s.delete_many([key(1), key(4)]) == 2
        s.evict_to(s.stats().bytes_used - SLOT)  # the least recently used one goes too
        kept = [i for i in range(6) if s.exists_many([key(i)])[0]]
    assert len(kept) == 3
    damage_index(d)
    with open_store(d) as s:
        assert s.rebuilt_from
        assert [i for i in range(6) if s.exists_many([key(i)])[0]] == kept
        assert exact(s, kept)


# ---- durability of names -------------------------------------------------------------------------

def test_new_slab_names_are_fsynced_into_the_directory_and_puts_are_not(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    with open_store(d) as s:
        synced: list[str] = []
        real = cachedir.fsync_dir
        monkeypatch.setattr(cachedir, "fsync_dir", lambda p: (synced.append(p), real(p))[1])
        assert put(s, range(4)) == [True] * 4      # a new slab
        assert synced == [str(d)]
        assert put(s, range(4, 40)) == [True] * 36  # the same slab: no directory fsync per put
        assert synced == [str(d)]


# ---- the fd cache ----------------------------------------------------------------------------------

def open_slab_fds(d) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(str(d))
        except OSError:
            pass
    return n


def test_slab_fd_cache_is_bounded(tmp_path):
    d = tmp_path / "cache"
    with open_store(d, segment_size=SLOT, max_open_slabs=3, io_threads=4) as s:  # a slab per block
        assert put(s, range(20)) == [True] * 20
        assert len(slabs_of(d)) in (20, 21)    # + at most one slab reserved ahead
        assert exact(s, range(20))
        assert s._state.slabs.open_count() <= 3
        assert open_slab_fds(d) <= 3 + 7  # + index.db, -wal, -shm (writer, reader), the lease


def test_fd_cache_churn_under_concurrent_threads_never_mixes_files(tmp_path):
    d = tmp_path / "cache"
    with open_store(d, segment_size=2 * SLOT, max_open_slabs=1, io_threads=4) as s:
        errors: list[str] = []

        def work(t: int) -> None:
            ids = range(t * 16, t * 16 + 16)
            for _ in range(2):
                if not all(put(s, ids)) or not exact(s, ids):
                    errors.append(f"thread {t}")

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert exact(s, range(64))


# ---- a missing index ---------------------------------------------------------------------------

def test_missing_index_beside_slabs_is_rebuilt_from_their_headers(tmp_path):
    d = tmp_path / "cache"
    with open_store(d) as s:
        assert put(s, range(6)) == [True] * 6
        assert s.delete_many([key(5)]) == 1
    for name in ("index.db", "index.db-wal", "index.db-shm"):
        if os.path.lexists(d / name):
            os.unlink(d / name)          # `rm index.db*`: the slabs are all that is left
    with open_store(d) as s:
        assert s.exists_many([key(i) for i in range(6)]) == [True] * 5 + [False]
        assert exact(s, range(5))
        assert put(s, [7]) == [True] and exact(s, [7])


def test_a_new_directory_opens_without_a_rebuild(tmp_path, caplog):
    with open_store(tmp_path / "fresh") as s:
        assert put(s, [1]) == [True]
    assert "rebuild" not in caplog.text
