"""The cache directory's safety: who owns it, how its files are opened, its lock, its fsyncs.

Trust: the directory and every file in it belong to the service user (the effective uid). Once the
directory is checked (owned by that user, writable by nobody else), no other local user can add,
rename or replace an entry in it, and its mode 0700 keeps them from reading any block.

Primitives:
- `prepare(path)`: create the directory 0700 (its new name fsync'ed into its parent), or check an
  existing one as ssh checks `~/.ssh`: not owned by the service user, or writable by group/others
  -> `StoreError` naming the path and the fix (`chown` / `chmod 700`); readable by others -> tightened
  to 0700 (logged); an ancestor writable by others without the sticky bit -> refused.
- `open_file(path, flags, create=)`: O_NOFOLLOW | O_CLOEXEC (and O_CREAT | O_EXCL, mode 0600, when
  creating): a symlink is refused, never followed; anything but a regular file of the service user
  is refused (`UnsafeFile`, an OSError); a file readable by others is tightened to 0600.
- `own_file(path)`: the same checks, by lstat, on a file another library opens by name (SQLite's
  index, -wal, -shm): created 0600 if missing (`create=True`), checked and tightened if present.
- `fsync_dir(path)`: make new or renamed names in a directory durable.
- `locked(path, timeout_s)`: the directory's lock file, flock'ed with a deadline -> `StoreError`
  saying who to look for when another process holds it longer.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import pwd
import stat
import time
from typing import Iterator

from offload.errors import StoreError

log = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeFile(OSError):
    """A name in the cache directory that is not a regular file of the service user."""


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare(path: str, what: str = "store.path") -> str:
    """The absolute path of a cache directory that is safe to use (created if missing)."""
    path = os.path.abspath(path)
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        st = _create(path, what)
    except OSError as e:
        raise StoreError(f"{what} {path!r}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StoreError(f"{what} {path!r} is not a directory")
    me = os.geteuid()
    if st.st_uid != me:
        raise StoreError(
            f"{what} {path!r} is owned by {user_name(st.st_uid)}, not by {user_name(me)} (the user "
            f"this service runs as): its owner could read every cached block or plant links in it. "
            f"Fix: `chown -R {user_name(me)} {path}` if it is yours, or choose another directory")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise StoreError(
            f"{what} {path!r} is writable by group/others (mode {mode:04o}): another local user "
            f"could plant files or links in it. Fix: `chmod 700 {path}`")
    if mode & 0o077:
        os.chmod(path, DIR_MODE)
        log.warning("%s %s was readable by others (mode %04o): now 0700", what, path, mode)
    _check_ancestors(path, what)
    return path


def _create(path: str, what: str) -> os.stat_result:
    parent = os.path.dirname(path)
    try:
        os.makedirs(parent, exist_ok=True)
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:  # another process created it meanwhile: checked like any other
            return os.stat(path)
        os.chmod(path, DIR_MODE)  # exactly 0700 whatever the umask
        fsync_dir(parent)
        return os.stat(path)
    except OSError as e:
        raise StoreError(f"{what} {path!r}: cannot create the directory: {e.strerror}") from None


def _check_ancestors(path: str, what: str) -> None:
    """An ancestor others may write without the sticky bit lets them rename our directory away."""
    cur = os.path.dirname(os.path.realpath(path))
    while True:
        try:
            st = os.stat(cur)
        except OSError:
            return
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o002 and not mode & stat.S_ISVTX:
            raise StoreError(
                f"{what} {path!r}: its parent {cur!r} is writable by every user without the sticky "
                f"bit (mode {mode:04o}), so anyone could replace the cache directory. Fix: "
                f"`chmod o-w {cur}` (or `chmod +t {cur}`), or choose another directory")
        parent = os.path.dirname(cur)
        if parent == cur:
            return
        cur = parent


def _unsafe(path: str, why: str) -> UnsafeFile:
    return UnsafeFile(errno.EPERM, f"refused: {why}", path)


def open_file(path: str, flags: int, *, create: bool = False) -> int:
    """An fd of a regular file of the service user; a symlink is refused (ELOOP), never followed.

    With `create`, the name must not exist (O_EXCL) and the file is made with mode 0600.
    """
    # O_NONBLOCK: a planted FIFO must not hang the open (no effect on regular files)
    f = flags | _NOFOLLOW | os.O_NONBLOCK | (os.O_CREAT | os.O_EXCL if create else 0)
    try:
        fd = os.open(path, f, FILE_MODE)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _unsafe(path, "a symbolic link (never followed)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _unsafe(path, "not a regular file")
        if st.st_uid != os.geteuid():
            raise _unsafe(path, f"owned by {user_name(st.st_uid)}")
        if stat.S_IMODE(st.st_mode) != FILE_MODE and (create or st.st_mode & 0o077):
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def own_file(path: str, *, create: bool = False) -> bool:
    """Check (and tighten) a file another library opens by name (SQLite's index, -wal, -shm);
    create it 0600 if missing and `create`. Returns whether a file was created (its name still
    needs `fsync_dir`).

    Checked with lstat, never opened: closing any fd of a file SQLite has open in this process
    would drop SQLite's own POSIX locks on it (another process could then reset the -shm under our
    mapping, or delete a WAL in use). The directory is the service user's, so nobody else can swap
    the name between this check and SQLite's open.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            return False
        try:
            os.close(open_file(path, os.O_RDWR, create=True))  # a new inode: nobody's locks on it
            return True
        except FileExistsError:  # created meanwhile by another process: check that one
            st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise _unsafe(path, "a symbolic link (never followed)")
    if not stat.S_ISREG(st.st_mode):
        raise _unsafe(path, "not a regular file")
    if st.st_uid != os.geteuid():
        raise _unsafe(path, f"owned by {user_name(st.st_uid)}")
    if st.st_mode & 0o077:
        os.chmod(path, FILE_MODE)
    return False


def control_error(e: OSError, what: str) -> StoreError:
    """A control-path error for a refused or unopenable file, naming it and the fix."""
    path = e.filename or "?"
    if isinstance(e, UnsafeFile):
        return StoreError(f"{what} {path!r} {e.strerror}: only the service user's own files are "
                          f"used. Fix: remove it (`rm {path}`) after checking who put it there")
    return StoreError(f"{what} {path!r}: {e.strerror}")


@contextlib.contextmanager
def locked(path: str, timeout_s: float) -> Iterator[None]:
    """Hold the exclusive flock on `path` (created 0600 if missing), waiting at most `timeout_s`."""
    try:
        try:
            fd = open_file(path, os.O_RDWR)
        except FileNotFoundError:
            try:
                fd = open_file(path, os.O_RDWR, create=True)
                fsync_dir(os.path.dirname(path))
            except FileExistsError:
                fd = open_file(path, os.O_RDWR)
    except OSError as e:
        raise control_error(e, "lock file") from None
    try:
        deadline = time.monotonic() + timeout_s
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreError(
                        f"lock file {path!r} is held by another process for more than "
                        f"{timeout_s:g} s (`fuser -v {path}` shows which); the store cannot "
                        f"open its index until it is released") from None
                time.sleep(min(delay, left))
                delay = min(delay * 2, 0.05)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


__all__ = ["DIR_MODE", "FILE_MODE", "UnsafeFile", "control_error", "fsync_dir", "locked",
           "open_file", "own_file", "prepare", "user_name"]
