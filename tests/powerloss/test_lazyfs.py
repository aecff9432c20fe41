"""The instrument itself: lazyfs keeps exactly what POSIX promises across a power cut, and no more.

If lazyfs kept too much (wrote names or data through before an fsync), test_powerloss.py could not
catch a missing fsync; these cases pin what it forgets. Also checks what the stores rely on: O_DIRECT
I/O, SQLite in WAL mode (shared-memory -shm by mmap, byte-range locks), flock, hole punching.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import sqlite3
from pathlib import Path

import pytest

from tests.powerloss.harness import LazyMount, lazyfs_unavailable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120),
              pytest.mark.skipif(bool(lazyfs_unavailable()), reason=lazyfs_unavailable() or "-")]


@pytest.fixture
def fs(tmp_path: Path):
    m = LazyMount(tmp_path / "backing", tmp_path / "mnt", tmp_path / "lazyfs.log")
    (m.backing / "old").write_bytes(b"durable")
    m.mount()
    try:
        yield m
    finally:
        m.cut()


def _write(path: Path, data: bytes, sync: bool) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, data, 0)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _after_cut(m: LazyMount) -> dict[str, bytes]:
    m.cut()
    return {p.name: p.read_bytes() for p in sorted(m.backing.iterdir())}


def test_only_fsynced_data_under_fsynced_names_survives(fs: LazyMount) -> None:
    mnt = fs.mountpoint
    _write(mnt / "unlinked_later", b"data synced", sync=True)
    _write(mnt / "kept", b"kept", sync=True)
    _write(mnt / "empty", b"not synced", sync=False)
    _fsync_dir(mnt)                                                  # names durable from here
    _write(mnt / "kept", b"KEPT+more", sync=False)                   # data after the last fsync
    os.rename(mnt / "old", mnt / "renamed")                          # directory not synced again
    _write(mnt / "new_after", b"x", sync=True)                       # data synced, name not: lost
    os.unlink(mnt / "unlinked_later")                               # not durable either
    assert (mnt / "kept").read_bytes() == b"KEPT+more"               # the live view has it all
    assert _after_cut(fs) == {"old": b"durable", "kept": b"kept", "empty": b"",
                              "unlinked_later": b"data synced"}


def test_early_writeback_may_keep_unsynced_changes(tmp_path: Path) -> None:
    m = LazyMount(tmp_path / "backing", tmp_path / "mnt", tmp_path / "lazyfs.log", writeback=1.0)
    m.mount()
    try:
        _write(m.mountpoint / "unsynced", b"kept anyway", sync=False)
    finally:
        m.cut()
    assert (m.backing / "unsynced").read_bytes() == b"kept anyway"


def test_renames_truncates_and_punched_holes_are_durable_once_synced(fs: LazyMount) -> None:
    mnt = fs.mountpoint
    _write(mnt / "f", b"a" * 10000, sync=True)
    _fsync_dir(mnt)
    fd = os.open(mnt / "f", os.O_RDWR)
    os.ftruncate(fd, 100)
    os.ftruncate(fd, 8192)                     # the bytes past 100 now read as zeros
    assert os.pread(fd, 200, 0) == b"a" * 100 + bytes(100)
    os.pwrite(fd, b"b" * 4096, 8192)
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.fallocate(fd, 0x01 | 0x02, ctypes.c_long(0), ctypes.c_long(50)) == 0
    os.fsync(fd)
    os.close(fd)
    os.replace(mnt / "f", mnt / "g")
    os.unlink(mnt / "old")
    _fsync_dir(mnt)
    assert _after_cut(fs) == {"g": bytes(50) + b"a" * 50 + bytes(8092) + b"b" * 4096}


def test_o_direct_sqlite_wal_and_locks_work(fs: LazyMount) -> None:
    mnt = fs.mountpoint
    fd = os.open(mnt / "direct", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    buf, back = mmap.mmap(-1, 8192), mmap.mmap(-1, 8192)
    buf.write(os.urandom(8192))
    assert os.pwritev(fd, [buf], 4096) == 8192
    os.fdatasync(fd)
    _fsync_dir(mnt)
    assert os.preadv(fd, [back], 4096) == 8192 and back[:] == buf[:]
    os.close(fd)
    db = sqlite3.connect(mnt / "x.db", isolation_level=None)
    assert db.execute("PRAGMA journal_mode=WAL").fetchone() == ("wal",)
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE t(a)")
    db.execute("INSERT INTO t VALUES (1)")
    other = sqlite3.connect(mnt / "x.db", isolation_level=None)     # reads through the -shm mmap
    assert other.execute("SELECT a FROM t").fetchall() == [(1,)]
    other.execute("BEGIN IMMEDIATE")                                # byte-range locks
    with pytest.raises(sqlite3.OperationalError):
        db.execute("PRAGMA busy_timeout=0").fetchall()
        db.execute("INSERT INTO t VALUES (2)")
    other.execute("ROLLBACK")
    with open(mnt / "lock", "a+") as a, open(mnt / "lock", "a+") as b:
        fcntl.flock(a, fcntl.LOCK_EX)
        with pytest.raises(BlockingIOError):
            fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
    other.close()
    db.close()
    after = _after_cut(fs)
    assert after["direct"] == bytes(4096) + buf[:]
    check = sqlite3.connect(fs.backing / "x.db")
    assert check.execute("SELECT a FROM t").fetchall() == [(1,)]    # the committed row survived
    check.close()
