"""The cache directory's safety: who owns it, how its files are opened, its lock, its fsyncs.

Trust: the directory and every file in it belong to the service user (the effective uid). Once the
directory is checked (owned by that user, writable by nobody else), no other local user can add,
rename or replace an entry in it, and its mode 0700 keeps them from reading any block.

Primitives:
- `prepare(path)`: walk the path from `/` one component at a time, each opened with O_NOFOLLOW
  relative to its parent's fd and checked on that fd: every ancestor owned by root or the service
  user and writable by nobody else, or sticky (like /tmp) with the next component owned by root or
  the service user; a symlink followed only where nobody else could have planted it. Create the
  directory 0700 (its new name fsync'ed into its parent), or check an existing one as ssh checks
  `~/.ssh`: not owned by the service user, or writable by group/others -> `StoreError` naming the
  path and the fix (`chown` / `chmod 700`); readable by others -> tightened to 0700 through its fd.
  Returns the path with its links resolved; since nobody else can rename or replace any component
  of it, opening names under it later reaches the directory that was checked.
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
    """The path of a cache directory that is safe to use (created if missing), with every link
    in it resolved: later opens by that path cannot be redirected by another local user."""
    fd, real = _open_dir(os.path.abspath(path), what)
    try:
        st = os.fstat(fd)
        me = os.geteuid()
        if st.st_uid != me:
            raise StoreError(
                f"{what} {path!r} is owned by {user_name(st.st_uid)}, not by {user_name(me)} (the "
                f"user this service runs as): its owner could read every cached block or plant "
                f"links in it. Fix: `chown -R {user_name(me)} {path}` if it is yours, or choose "
                f"another directory")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o022:
            raise StoreError(
                f"{what} {path!r} is writable by group/others (mode {mode:04o}): another local "
                f"user could plant files or links in it. Fix: `chmod 700 {path}`")
        if mode & 0o077:
            os.fchmod(fd, DIR_MODE)   # through the fd: never through a link
            log.warning("%s %s was readable by others (mode %04o): now 0700", what, path, mode)
    finally:
        os.close(fd)
    return real


_PATH = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_LINKS = 40


def _open_dir(path: str, what: str) -> tuple[int, str]:
    """An fd of the directory `path` (created 0700 if missing) and its path with links resolved.

    Walked one component at a time from `/` with O_NOFOLLOW, each opened relative to its parent's
    fd and checked on that fd (`_check_parent`), so what is checked is what is used. A symbolic
    link is followed only if nobody but root and the service user could have planted it (it lies
    in a directory writable by nobody else, or is owned by root or the service user); its target
    is walked the same way.
    """
    me = os.geteuid()
    links = 0
    while True:
        todo = [p for p in path.split("/") if p and p != "."]
        fd = os.open("/", _PATH)
        real = "/"
        try:
            while todo:
                name = todo.pop(0)
                last = not todo
                shared = _check_parent(fd, real, path, what, me)
                try:
                    nfd = os.open(name, _PATH, dir_fd=fd)
                except FileNotFoundError:
                    _mkdir(fd, name, last, path, what)
                    nfd = os.open(name, _PATH, dir_fd=fd)
                except OSError as e:
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise StoreError(f"{what} {path!r}: {os.path.join(real, name)}: "
                                         f"{e.strerror}") from None
                    lst = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    here = os.path.join(real, name)
                    if not stat.S_ISLNK(lst.st_mode):
                        raise StoreError(f"{what} {path!r}: {here} is not a directory") from None
                    if shared and lst.st_uid not in (0, me):
                        raise StoreError(
                            f"{what} {path!r}: {here} is a symbolic link planted by "
                            f"{user_name(lst.st_uid)} in a directory every user may write: never "
                            f"followed. Fix: remove it after checking who put it there, or "
                            f"choose a directory that is not in a shared one") from None
                    links += 1
                    if links > MAX_LINKS:
                        raise StoreError(f"{what} {path!r}: too many symbolic links") from None
                    target = os.readlink(name, dir_fd=fd)
                    path = os.path.normpath(os.path.join(real, target, *todo))
                    break
                owner = os.fstat(nfd).st_uid
                if shared and not last and owner not in (0, me):
                    os.close(nfd)
                    raise StoreError(
                        f"{what} {path!r}: {os.path.join(real, name)} is owned by "
                        f"{user_name(owner)} inside a directory every user may "
                        f"write, so that user could swap what lies below it. Fix: choose a "
                        f"directory of your own")
                os.close(fd)
                fd, real = nfd, os.path.join(real, name)
            else:
                out = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                return out, real
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)   # a link was found: walk its target from the top


def _check_parent(fd: int, real: str, path: str, what: str, me: int) -> bool:
    """Refuse an ancestor another user could rename entries in (owned by another user, or
    writable by group/others without the sticky bit). Returns whether it is shared (sticky and
    writable by others: entries of root and the service user in it cannot be moved by others)."""
    st = os.fstat(fd)
    if st.st_uid not in (0, me):
        raise StoreError(
            f"{what} {path!r}: its parent {real!r} is owned by {user_name(st.st_uid)}, who could "
            f"replace the cache directory. Fix: choose a directory whose parents belong to root "
            f"or {user_name(me)}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022 and not mode & stat.S_ISVTX:
        who, fix = ("every user", "o-w") if mode & 0o002 else ("its group", "g-w")
        raise StoreError(
            f"{what} {path!r}: its parent {real!r} is writable by {who} without the sticky "
            f"bit (mode {mode:04o}), so they could replace the cache directory. Fix: "
            f"`chmod {fix} {real}` (or `chmod +t {real}`), or choose another directory")
    return bool(mode & 0o022)


def _mkdir(parent: int, name: str, last: bool, path: str, what: str) -> None:
    """Create a missing component: 0755 on the way, exactly 0700 for the cache directory (its
    name fsync'ed into its parent)."""
    try:
        os.mkdir(name, DIR_MODE if last else 0o755, dir_fd=parent)
    except FileExistsError:   # another process created it meanwhile: checked like any other
        return
    except OSError as e:
        raise StoreError(f"{what} {path!r}: cannot create the directory: {e.strerror}") from None
    if last:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=parent)
        try:
            os.fchmod(fd, DIR_MODE)   # exactly 0700 whatever the umask
        finally:
            os.close(fd)
    try:
        pfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent)
    except OSError:   # a parent we may not read: its owner makes names durable
        return
    try:
        os.fsync(pfd)
    finally:
        os.close(pfd)


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
    """Hold the exclusive flock on `path` (created 0600 if missing) and on its directory, waiting
    at most `timeout_s`. The directory's flock is what excludes this version's openers (a cleaner
    may delete a lock file nobody writes to, and the next opener would lock a new one); the file's
    is what an older version sharing the directory waits on."""
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
        dfd = os.open(os.path.dirname(path) or ".",
                      os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        os.close(fd)
        raise control_error(e, "cache directory") from None
    try:
        deadline = time.monotonic() + timeout_s
        for held in (fd, dfd):   # always in this order: no two openers wait on each other
            _flock(held, path, deadline, timeout_s)
        try:
            yield
        finally:
            fcntl.flock(dfd, fcntl.LOCK_UN)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(dfd)
        os.close(fd)


def _flock(fd: int, path: str, deadline: float, timeout_s: float) -> None:
    delay = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreError(
                    f"lock file {path!r} is held by another process for more than "
                    f"{timeout_s:g} s (`fuser -v {path}` shows which); the store cannot "
                    f"open its index until it is released") from None
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.05)


__all__ = ["DIR_MODE", "FILE_MODE", "UnsafeFile", "control_error", "fsync_dir", "locked",
           "open_file", "own_file", "prepare", "user_name"]
