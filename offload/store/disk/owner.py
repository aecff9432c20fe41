"""Who owns a reserved or pending slot, and whether that owner is alive: a lease the kernel keeps.

Every process that opens a cache directory holds a lease on it: a file `lease-<32 hex>` in the
directory, created 0600 under a temporary name, locked with an open file description lock
(`F_OFD_SETLK`, a write lock on the whole file) and only then renamed into place. Its owner token
(`lease:<32 hex>`) is what the index rows of its reserved and pending slots carry.

Liveness is the lock: the kernel drops an OFD lock when the last fd of its open file description
closes, which a process's death (SIGKILL, OOM kill, a container stopped) always does. `owner_alive`
asks the kernel (`F_OFD_GETLK`, which takes nothing) whether the lease is still locked, so it does
not depend on the caller sharing the owner's PID namespace (containers sharing one host directory),
on pids or start times, or on the owner being scheduled (a paused owner still holds its lock). A
lease file found unlocked belongs to a dead process and is removed; a token whose lease file is
gone is dead. Tokens of the older form (boot id : pid : start time, written by a previous version)
are judged as before, by this process's /proc (also the fallback, logged, on a file system
without OFD locks).

Primitives: `Lease(directory)` (`token`, `close()`), `owner_alive(directory, token)`,
`live_leases(directory, mine)` (the tokens of the other live holders: who a rebuild would hurt).
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


def _ofd(fd: int, cmd: int, kind: int) -> int:
    """fcntl with an OFD lock request on the whole file; returns the l_type the kernel answers."""
    got = fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, 0, 0, 0))
    return int(_FLOCK.unpack(got)[0])


class Lease:
    """This process's lease on `directory` (see the module docstring); `close()` ends it."""

    def __init__(self, directory: str):
        self.directory = directory
        name = secrets.token_hex(16)
        self.token = TOKEN_PREFIX + name
        self.path = os.path.join(directory, PREFIX + name)
        tmp = self.path + _NEW
        try:
            self._fd = cachedir.open_file(tmp, os.O_RDWR, create=True)
        except OSError as e:
            raise cachedir.control_error(e, "lease file") from None
        try:
            try:
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
        os.close(self._fd)
        self._fd = -1
        try:
            os.unlink(tmp)
        except OSError:
            pass

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self._fd)   # the lock goes with it
        self._fd = -1


def _lease_path(directory: str, token: str) -> str | None:
    name = token[len(TOKEN_PREFIX):]
    if len(name) != 32 or any(c not in "0123456789abcdef" for c in name):
        return None
    return os.path.join(directory, PREFIX + name)


def _locked(path: str) -> bool | None:
    """Whether the lease file at `path` is locked (None: no such file). An unlocked one is
    removed (its owner is dead)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("lease %s cannot be opened (%s): its owner is taken for alive", path, e)
        return True
    try:
        held = _ofd(fd, _F_OFD_GETLK, fcntl.F_WRLCK) != fcntl.F_UNLCK
    except OSError as e:   # never "dead" on a doubt: its slots wait for a later check
        log.warning("lease %s cannot be checked (%s): its owner is taken for alive", path, e)
        return True
    finally:
        os.close(fd)
    if not held:
        try:
            os.unlink(path)
        except OSError:
            pass
    return held


def owner_alive(directory: str, token: str | None) -> bool:
    """Whether the process that wrote `token` into the index still holds its lease."""
    if not token:
        return False
    if token.startswith(TOKEN_PREFIX):
        path = _lease_path(directory, token)
        return path is not None and bool(_locked(path))
    return _legacy_alive(token)


def live_leases(directory: str, mine: str | None = None) -> list[str]:
    """Tokens of every other process holding a lease on `directory` now (dead ones removed)."""
    out = []
    for name in sorted(os.listdir(directory)):
        if not name.startswith(PREFIX) or name.endswith(_NEW):
            continue
        token = TOKEN_PREFIX + name[len(PREFIX):]
        if token != mine and _lease_path(directory, token) and _locked(
                os.path.join(directory, name)):
            out.append(token)
    return out


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
