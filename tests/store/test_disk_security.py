"""The cache directory against other local users: private modes, refused directories, no symlink
followed, a lock nobody can hold the store hostage with. Real files, a real second user (`nobody`
through setpriv) where the machine allows it."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from typing import Iterator

import pytest

from offload.errors import StoreError
from offload.store.base import get_bytes
from offload.store.disk.slab import format as slot_format
from tests.store.blocks import data, key
from tests.store.stores import open_store

SIZE = 64 << 10
SLOT = slot_format.slot_bytes_for(SIZE)
SETPRIV = shutil.which("setpriv")
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def put(s, ids, size=SIZE) -> list[bool]:
    ks = [key(i) for i in ids]
    return s.put_many(ks, [[data(k, size)] for k in ks])


@pytest.fixture
def public_tmp() -> Iterator[str]:
    """A root-owned 0755 directory under /tmp that another local user can traverse."""
    d = tempfile.mkdtemp(prefix="offload-sec-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def as_nobody(*argv: str) -> subprocess.CompletedProcess:
    if os.geteuid() != 0 or SETPRIV is None:
        pytest.skip("needs root and setpriv to run a second local user (nobody)")
    return subprocess.run([SETPRIV, "--reuid", "nobody", "--regid", "nogroup", "--clear-groups",
                           *argv], capture_output=True, text=True, timeout=60)


# ---- modes ------------------------------------------------------------------------------------

def test_directory_is_0700_and_every_file_0600_whatever_the_umask(tmp_path):
    d = tmp_path / "cache"
    old = os.umask(0)
    try:
        with open_store(d) as s:
            assert put(s, range(3)) == [True] * 3
            assert put(s, [10], size=1 << 20) == [True]  # a second slab
            names = sorted(os.listdir(d))
            assert {"index.db", "index.db-wal", "index.db-shm", "lock"} <= set(names)
            assert sum(n.endswith(".slab") for n in names) == 2
            assert mode(d) == 0o700
            for n in names:
                assert mode(d / n) == 0o600, n
    finally:
        os.umask(old)


def test_existing_directory_readable_by_others_is_tightened(tmp_path):
    d = tmp_path / "cache"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    with open_store(d) as s:
        assert put(s, [1]) == [True]
    assert mode(d) == 0o700


# ---- refused directories --------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0o777, 0o770, 0o1777])
def test_directory_writable_by_others_is_refused_with_the_fix(tmp_path, bad):
    d = tmp_path / "cache"
    d.mkdir()
    os.chmod(d, bad)
    with pytest.raises(StoreError, match=r"writable by group/others.*chmod 700"):
        open_store(d)
    assert os.listdir(d) == []  # nothing created in it


def test_parent_writable_by_everyone_without_sticky_bit_is_refused(tmp_path):
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, 0o777)
    with pytest.raises(StoreError, match=r"chmod o-w"):
        open_store(parent / "cache")


def test_directory_of_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(StoreError, match=r"owned by .*chown"):
        open_store(d)


def test_directory_precreated_by_another_user_with_a_symlinked_slab(public_tmp, tmp_path):
    """The attack of issue 14: `nobody` creates the cache directory first and plants a slab that
    links to a file of the service user; the store must refuse the directory, not write the file."""
    os.chmod(public_tmp, 0o1777)  # like /tmp: anyone may create, nobody may rename others' entries
    d = os.path.join(public_tmp, "cache")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 1024)
    link = os.path.join(d, slot_format.segment_name(1, SLOT))
    r = as_nobody("sh", "-c", f"mkdir -m 777 {d} && ln -s {victim} {link}")
    assert r.returncode == 0, r.stderr
    with pytest.raises(StoreError, match=r"owned by nobody.*chown"):
        open_store(d)
    assert victim.read_bytes() == b"precious" * 1024


# ---- symlinks in our own directory -------------------------------------------------------------

def test_symlink_planted_as_the_next_slab_is_not_followed(tmp_path):
    d = tmp_path / "cache"
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 1024)
    d.mkdir(mode=0o700)
    os.symlink(victim, d / slot_format.segment_name(1, SLOT))
    with open_store(d) as s:
        assert put(s, range(4)) == [True] * 4
        assert all(get_bytes(s, key(i), SIZE) == data(key(i), SIZE) for i in range(4))
    assert victim.read_bytes() == b"precious" * 1024
    assert not any(os.path.islink(d / n) for n in os.listdir(d))


def test_slab_replaced_by_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    d = tmp_path / "cache"
    with open_store(d) as s:
        assert put(s, range(4)) == [True] * 4
    (name,) = [n for n in os.listdir(d) if n.endswith(".slab")]
    victim = tmp_path / "victim"
    shutil.move(str(d / name), victim)
    before = victim.read_bytes()
    os.symlink(victim, d / name)
    with open_store(d) as s:
        assert s.exists_many([key(i) for i in range(4)]) == [False] * 4
        assert get_bytes(s, key(0), SIZE) is None
        assert put(s, range(4, 8)) == [True] * 4
        assert get_bytes(s, key(5), SIZE) == data(key(5), SIZE)
    assert victim.read_bytes() == before


@pytest.mark.parametrize("name", ["index.db", "index.db-wal", "index.db-shm", "lock"])
def test_symlinked_index_files_and_lock_are_refused(tmp_path, name):
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 1024)
    os.symlink(victim, d / name)
    with pytest.raises(StoreError, match="symbolic link"):
        open_store(d)
    assert victim.read_bytes() == b"precious" * 1024


def test_index_file_of_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    d = tmp_path / "cache"
    with open_store(d) as s:
        assert put(s, [1]) == [True]
    os.chown(d / "index.db", 65534, 65534)
    with pytest.raises(StoreError, match="owned by nobody"):
        open_store(d)


# ---- the lock ------------------------------------------------------------------------------------

HOLDER = """
import fcntl, sys, time
f = open(sys.argv[1], "a+")
fcntl.flock(f, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(120)
"""


def hold_lock(path, *prefix: str) -> subprocess.Popen:
    p = subprocess.Popen([*prefix, PY, "-c", HOLDER, str(path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    if line.strip() != "locked":
        p.kill()
        raise AssertionError(f"holder did not lock: {line!r} {p.stderr.read() if p.stderr else ''}")
    return p


def in_thread(fn):  # type: ignore[no-untyped-def]
    """Run fn in a thread; a hang shows as a failure (after 60 s), not as a stuck test run."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "hung while the lock was held"
    return out


def test_open_gives_up_on_a_held_lock_with_a_clear_error(tmp_path):
    d = tmp_path / "cache"
    open_store(d).close()
    holder = hold_lock(d / "lock")
    try:
        got = in_thread(lambda: open_store(d, lock_timeout_s=0.3))
        assert isinstance(got.get("error"), StoreError), got
        assert "held by another process" in str(got["error"]) and "fuser" in str(got["error"])
    finally:
        holder.kill()
        holder.wait()
    with open_store(d, lock_timeout_s=5) as s:  # released: opens again
        assert put(s, [1]) == [True]


def test_data_path_reopening_the_index_misses_while_the_lock_is_held(tmp_path):
    d = tmp_path / "cache"
    with open_store(d) as s:
        assert put(s, range(3)) == [True] * 3
        holder = hold_lock(d / "lock")
        try:
            s._index.ino = -1  # as if another process had set the index aside and rebuilt it
            got = in_thread(lambda: s.exists_many([key(0)]))
            assert got.get("value") == [False], got  # a miss within the deadline, not a hang
        finally:
            holder.kill()
            holder.wait()
        assert s.exists_many([key(0), key(1), key(2)]) == [True] * 3  # reopened once released
        assert get_bytes(s, key(1), SIZE) == data(key(1), SIZE)


def test_another_local_user_cannot_read_blocks_or_take_the_lock(public_tmp):
    d = os.path.join(public_tmp, "cache")
    with open_store(d) as s:
        assert put(s, range(2)) == [True] * 2
        (name,) = [n for n in os.listdir(d) if n.endswith(".slab")]
        r = as_nobody(PY, "-c", f"open({os.path.join(d, name)!r}, 'rb').read(1)")
        assert r.returncode != 0 and "Permission denied" in r.stderr
        r = as_nobody(PY, "-c", HOLDER, os.path.join(d, "lock"))
        assert r.returncode != 0 and "Permission denied" in r.stderr
        assert put(s, [5]) == [True]
    with open_store(d, lock_timeout_s=5) as s:
        assert get_bytes(s, key(5), SIZE) == data(key(5), SIZE)
