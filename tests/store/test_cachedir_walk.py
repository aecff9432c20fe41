"""The cache path walked without following another user's links: each component opened with
O_NOFOLLOW relative to its parent's fd and checked there. A symlink planted at the cache path by
another local user (`nobody`, through setpriv; fs.protected_symlinks may be 0) is refused and its
target untouched; parents owned by another user or writable by a group without the sticky bit are
refused; /tmp-style sticky parents and links of root or the service user are fine."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from typing import Iterator

import pytest

from offload.errors import StoreError
from offload.store.disk import cachedir
from tests.store.blocks import data, key
from tests.store.stores import open_store

SETPRIV = shutil.which("setpriv")


@pytest.fixture
def shared_tmp() -> Iterator[str]:
    """A root-owned directory like /tmp (1777): every user may create entries in it."""
    d = tempfile.mkdtemp(prefix="offload-walk-", dir="/tmp")
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def as_nobody(*argv: str, ok: bool = True) -> subprocess.CompletedProcess:
    if os.geteuid() != 0 or SETPRIV is None:
        pytest.skip("needs root and setpriv to run a second local user (nobody)")
    r = subprocess.run([SETPRIV, "--reuid", "nobody", "--regid", "nogroup", "--clear-groups",
                        *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 or not ok, r.stderr
    return r


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_symlink_planted_at_the_cache_path_by_another_user_is_not_followed(shared_tmp, tmp_path):
    victim = tmp_path / "victim"            # a directory of the service user, e.g. /etc
    victim.mkdir(mode=0o755)
    os.chmod(victim, 0o755)
    (victim / "passwd").write_text("precious")
    path = os.path.join(shared_tmp, "cache")
    as_nobody("ln", "-s", str(victim), path)
    with pytest.raises(StoreError, match=r"symbolic link planted by nobody"):
        open_store(path)
    assert mode(victim) == 0o755 and os.listdir(victim) == ["passwd"]


def test_parent_owned_by_another_user_is_refused(shared_tmp):
    theirs = os.path.join(shared_tmp, "theirs")
    as_nobody("mkdir", "-m", "755", theirs)
    with pytest.raises(StoreError, match=r"owned by nobody"):
        open_store(os.path.join(theirs, "cache"))


def test_our_directory_swapped_under_another_users_parent_is_refused(shared_tmp, tmp_path):
    """Who owns the parent can rename our directory away and put a link in its place: here to
    another directory of the service user, which would then be taken over as the cache."""
    theirs = os.path.join(shared_tmp, "theirs")
    as_nobody("mkdir", "-m", "755", theirs)
    other = tmp_path / "other"                 # the service user's own, 0700
    other.mkdir(mode=0o700)
    as_nobody("ln", "-s", str(other), os.path.join(theirs, "cache"))
    with pytest.raises(StoreError, match=r"owned by nobody"):
        open_store(os.path.join(theirs, "cache"))
    assert os.listdir(other) == []


@pytest.mark.parametrize("bad, fix", [(0o775, "g-w"), (0o777, "o-w")])
def test_parent_writable_by_a_group_or_everyone_without_sticky_bit_is_refused(tmp_path, bad, fix):
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, bad)
    with pytest.raises(StoreError, match=rf"chmod {fix}"):
        open_store(parent / "cache")
    assert not (parent / "cache").exists()


def test_own_directory_in_a_sticky_shared_parent_is_used(shared_tmp):
    path = os.path.join(shared_tmp, "cache")
    with open_store(path) as s:
        assert s.put_many([key(1)], [[data(key(1), 4096)]]) == [True]
        assert s.directory == path
    assert mode(path) == 0o700


def test_links_of_root_or_the_service_user_are_followed_and_resolved(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    os.symlink(real, tmp_path / "link")                 # like /var/run -> /run
    got = cachedir.prepare(str(tmp_path / "link" / "cache"))
    assert got == str(real / "cache") and mode(real / "cache") == 0o700


def test_a_cache_path_through_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match=r"not a directory"):
        cachedir.prepare(str(tmp_path / "file" / "cache"))


def test_another_user_can_neither_hard_link_nor_plant_links_in_the_cache_directory(shared_tmp):
    path = os.path.join(shared_tmp, "cache")
    with open_store(path) as s:
        assert s.put_many([key(1)], [[data(key(1), 4096)]]) == [True]
        s.flush()
        (slab,) = [n for n in os.listdir(path) if n.endswith(".slab")]
        for argv in (["ln", os.path.join(path, slab), os.path.join(shared_tmp, "stolen")],
                     ["ln", "-s", "/etc", os.path.join(path, "seg-000099-8192.slab")],
                     ["mv", path, os.path.join(shared_tmp, "moved")]):
            r = as_nobody(*argv, ok=False)
            assert r.returncode != 0 and ("Permission denied" in r.stderr
                                          or "not permitted" in r.stderr), r.stderr
        assert sorted(os.listdir(shared_tmp)) == ["cache"]
