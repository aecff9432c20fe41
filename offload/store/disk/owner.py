"""Who owns a reserved or pending slot, and whether that owner is alive: a lock the kernel keeps.

Every process that opens a cache directory holds a lease on it, named by a random token
`lease:<32 hex>` (what the index rows of its reserved and pending slots carry). The lease is an
open file description lock (`F_OFD_SETLK`) of one byte of **the cache directory itself**, at the
offset its token names (`_offset`: the token's first 60 bits), taken on the directory's own
descriptor before the token is used. A file `lease-<32 hex>` (0600, locked the same way, created
under a temporary name and renamed into place once locked) is kept beside it for an older version
of this store sharing the directory, which judges owners by that file; it is never evidence of
anything here.

Liveness is the lock and nothing else (`owner_alive`, the one rule every reclaim and rebuild
decision goes through): the kernel drops an OFD lock when the last fd of its open file description
closes, which a process's death (SIGKILL, OOM kill, a container stopped) always does, and only
then. A name cannot take it away: an age-based cleaner (`find -mtime +N -delete`,
systemd-tmpfiles) or an operator's `rm lease-*` may delete or replace a lease file, but the lock
lives on the directory's inode, which no cleaner removes while the directory holds anything. The
check (`F_OFD_GETLK`, which takes nothing) does not depend on the caller sharing the owner's PID
namespace (containers sharing one host directory), on pids or start times, or on the owner being
scheduled (a paused owner still holds its lock). An owner is dead only when its byte of the
directory is unlocked and no lease file of its name is locked (an older version's process holds
only that); a dead owner's lease file is removed. Tokens of the older form (boot id : pid : start
time, written by a previous version) are judged as before, by this process's /proc (also the
fallback, logged, on a file system without OFD locks).

Primitives: `Lease(directory)` (`token`, `close()`), `owner_alive(directory, token)`,
`live_leases(directory, mine)` (every other live holder: who a rebuild would hurt).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import struct

from offload.store.disk import cachedir

log = logging.getLogger(__name__)

PREFIX = "lease-"
TOKEN_PREFIX = "lease:"
_NEW = ".new"
# struct flock (Linux, 64-bit off_t): l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
_FLOCK = struct.Struct("hhxxxxqqi4x")
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_UNSUPPORTED = (errno.EINVAL, errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)


_HEX = frozenset("0123456789abcdef")
_MAX_HOLDERS = 4096   # locks enumerated on one directory at most (each a live opener)


def _ofd(fd: int, cmd: int, kind: int, start: int = 0, length: int = 0) -> tuple[int, int, int]:
    """fcntl with an OFD lock request on [start, start + length) (length 0: to the end); returns
    (l_type, l_start, l_len) as the kernel answers."""
    got = fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))
    kind, _, start, length, _ = _FLOCK.unpack(got)
    return int(kind), int(start), int(length)


def _name(token: str) -> str | None:
    """The 32 hex digits of a `lease:` token (None: not one)."""
    name = token[len(TOKEN_PREFIX):]
    return name if len(name) == 32 and set(name) <= _HEX else None


def _offset(name: str) -> int:
    """The byte of the directory whose lock is the lease named `name` (60 bits: < 2^63)."""
    return int(name[:15], 16)


def _open_dir(directory: str) -> int:
    return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


class Lease:
    """This process's lease on `directory` (see the module docstring); `close()` ends it."""

    def __init__(self, directory: str):
        self.directory = directory
        name = secrets.token_hex(16)
        self.token = TOKEN_PREFIX + name
        self.path = os.path.join(directory, PREFIX + name)
        self._fd = self._dirfd = -1
        tmp = self.path + _NEW
        try:
            self._dirfd = _open_dir(directory)
            self._fd = cachedir.open_file(tmp, os.O_RDWR, create=True)
        except OSError as e:
            self._drop(tmp)
            raise cachedir.control_error(e, "lease file") from None
        try:
            try:   # the lease itself: one byte of the directory, then the file (older versions)
                _ofd(self._dirfd, _F_OFD_SETLK, fcntl.F_RDLCK, _offset(name), 1)
                _ofd(self._fd, _F_OFD_SETLK, fcntl.F_WRLCK)
            except OSError as e:
                if e.errno not in _UNSUPPORTED:
                    raise
                self._unsupported(tmp, e)
                return
            os.rename(tmp, self.path)   # locked before its name can be seen
        except OSError as e:
            self._drop(tmp)
            raise cachedir.control_error(e, "lease file") from None

    def _unsupported(self, tmp: str, e: OSError) -> None:
        """A file system without OFD locks: the previous version's token (judged by /proc)."""
        log.warning("%s: open file description locks unsupported (%s): process liveness falls "
                    "back to pids, which is wrong across PID namespaces (containers sharing "
                    "this directory)", self.directory, e.strerror)
        self._drop(tmp)
        self.token = legacy_token()

    def _drop(self, tmp: str) -> None:
        for fd in (self._fd, self._dirfd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._dirfd = -1
        try:
            os.unlink(tmp)
        except OSError:
            pass

    def close(self) -> None:
        if self._dirfd < 0:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self._fd)
        os.close(self._dirfd)   # the lock goes with it
        self._fd = self._dirfd = -1


def _dir_held(directory: str, offsets: list[int]) -> list[bool] | None:
    """Whether each byte of the directory is locked (by any process: the caller's own locks are
    on other open file descriptions, so they count too). None: it cannot be asked."""
    try:
        fd = _open_dir(directory)
    except OSError as e:
        log.warning("%s cannot be opened to check leases (%s): every owner is taken for alive",
                    directory, e)
        return None
    try:
        return [_ofd(fd, _F_OFD_GETLK, fcntl.F_WRLCK, off, 1)[0] != fcntl.F_UNLCK
                for off in offsets]
    except OSError as e:   # never "dead" on a doubt: the slots wait for a later check
        log.warning("leases of %s cannot be checked (%s): every owner is taken for alive",
                    directory, e)
        return None
    finally:
        os.close(fd)


def _file_locked(path: str) -> bool:
    """Whether a lease file is locked (an older version's process holds only that). A missing,
    replaced or unlocked file proves nothing: it is never evidence of death on its own."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return _ofd(fd, _F_OFD_GETLK, fcntl.F_WRLCK)[0] != fcntl.F_UNLCK
    except OSError:
        return True
    finally:
        os.close(fd)


def _remove_dead(directory: str, name: str) -> None:
    """A dead owner's lease file (if any) goes."""
    try:
        os.unlink(os.path.join(directory, PREFIX + name))
    except OSError:
        pass


def owner_alive(directory: str, token: str | None) -> bool:
    """Whether the process that wrote `token` into the index still holds its lease: the one rule
    behind every reclaim of a slot and every rebuild (see the module docstring)."""
    if not token:
        return False
    if not token.startswith(TOKEN_PREFIX):
        return _legacy_alive(token)
    name = _name(token)
    if name is None:
        return False
    held = _dir_held(directory, [_offset(name)])
    if held is None or held[0] or _file_locked(os.path.join(directory, PREFIX + name)):
        return True
    _remove_dead(directory, name)
    return False


def _holders(fd: int) -> set[int]:
    """Offsets of every lock on the directory behind `fd` (each an opener's lease byte)."""
    out: set[int] = set()
    todo: list[tuple[int, int | None]] = [(0, None)]
    while todo and len(out) < _MAX_HOLDERS:
        lo, hi = todo.pop()
        if hi is not None and hi <= lo:
            continue
        kind, start, length = _ofd(fd, _F_OFD_GETLK, fcntl.F_WRLCK, lo,
                                   0 if hi is None else hi - lo)
        if kind == fcntl.F_UNLCK:
            continue
        start = max(start, lo)
        out.add(start)
        todo.append((lo, start))
        if length > 0:
            todo.append((start + length, hi))
    return out


def live_leases(directory: str, mine: str | None = None) -> list[str]:
    """Every other process holding a lease on `directory` now (dead ones' files removed): the
    tokens of lease files whose owner `owner_alive` finds alive, and `lease:<15 hex>` for a lock
    held on the directory whose file is gone. A doubt counts as a holder."""
    mine_name = _name(mine) if mine and mine.startswith(TOKEN_PREFIX) else None
    skip = _offset(mine_name) if mine_name else -1
    try:
        fd = _open_dir(directory)
        try:
            held = _holders(fd) - {skip}
        finally:
            os.close(fd)
    except OSError as e:
        log.warning("leases of %s cannot be listed (%s): taken for held", directory, e)
        return [TOKEN_PREFIX + "?"]
    out = []
    for entry in sorted(os.listdir(directory)):
        name = entry[len(PREFIX):]
        if not entry.startswith(PREFIX) or entry.endswith(_NEW) or _name(TOKEN_PREFIX + name) is None:
            continue
        if name == mine_name:
            continue
        if _offset(name) in held or owner_alive(directory, TOKEN_PREFIX + name):
            out.append(TOKEN_PREFIX + name)
            held.discard(_offset(name))
    return out + [f"{TOKEN_PREFIX}{off:015x}" for off in sorted(held)]


# ---- tokens of the previous version (boot id : pid : start time) --------------------------------

def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def _start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def legacy_token() -> str:
    pid = os.getpid()
    return f"{_boot_id()}:{pid}:{_start_time(pid)}"


def _legacy_alive(token: str) -> bool:
    boot, pid, start = (token.split(":") + ["", "", ""])[:3]
    if boot != _boot_id() or not pid.isdigit():
        return False
    return _start_time(int(pid)) == start and start != ""


__all__ = ["Lease", "TOKEN_PREFIX", "live_leases", "owner_alive"]
