"""Deployment secrets read from files: the ONE loader for every secret the service keeps in a file.

Every secret or key file is read here, by the Redis tier (`redis.secret_file`,
`redis.password_file`), the agent and its clients (`agent.secret_file`, the agent's keys file)
and the checks before start (`config validate`, `detect`, `launch`); nothing else opens one
(tests/store/test_secret_files.py walks the sources for other readers).

Primitives:
- `read_private_file(path, setting, max_bytes)` -> the file's bytes. The file is accepted only
  if it is, as opened (no check-then-open race: every check is on the open descriptor):
  in directories only root and the service user can change (every directory from / owned by
  one of them and not writable by group/others unless sticky, as /tmp; a symbolic link on the
  way followed only if one of them owns it: else another user could swap the file for another
  file of ours between runs), not a symbolic link (`O_NOFOLLOW`: a link lets whoever can write
  its directory choose what we read), a regular file (checked on an `O_PATH` descriptor before
  the file is opened for reading: opening a device or a FIFO has effects), owned by the service
  user (the effective uid: a file another user planted first, even mode 600, is theirs and its
  secret is known to them), private (no group/other permission bits, as ssh refuses a private
  key), with one name (a hard link elsewhere is another way in), and at most `max_bytes` long
  (read to at most `max_bytes` + 1, so a file growing after the check is refused too).
- `read_secret_file(path, setting, min_bytes)` -> the secret, stripped of surrounding
  whitespace, at least `min_bytes` (16 for a key, `MIN_SECRET_BYTES`) and at most
  `MAX_SECRET_BYTES` long.
- `PrivateCopy(path, setting)`: a file read by the loader, for a library that takes a path
  (OpenSSL's client key, `redis.tls_key_file`): the checked bytes in an anonymous memory file,
  named by `.path` (`/proc/self/fd/N`, readable by this process only) until `close()`.
Every refusal is a `ConfigError` of one line: the setting, the file, why, and the fix (printed
as one `error:` line). Kubernetes mounts a secret's file as a symbolic link into `..data/`:
name the file itself (`/etc/secret/..data/key`) or mount it with `subPath`. It imports nothing
of the agent package, so the agent can use it too.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
import weakref

from offload.errors import ConfigError

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 64 << 10        # a secret or password file
MAX_KEYS_FILE_BYTES = 1 << 20      # the agent's keys file (one table per host)


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


MAX_SYMLINKS = 40                  # symbolic links followed in the directories of one path (as Linux)
_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def _refuse(setting: str, path: str, why: str) -> ConfigError:
    return ConfigError([f"{setting}: {path} {why}"])


def _trusted(uid: int) -> bool:
    return uid in (0, os.geteuid())


def _check_dir(setting: str, path: str, where: str, st: os.stat_result) -> None:
    """A directory on the way to a secret file: only root or the service user may change what
    it names (owned by one of them; not writable by group/others unless sticky, as /tmp)."""
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(setting, path, f"cannot be read: {where} is not a directory")
    if not _trusted(st.st_uid):
        raise _refuse(setting, path, f"is in the directory {where}, which belongs to "
                      f"{_user(st.st_uid)}: they can replace the file; keep it in a directory "
                      f"of root or {_user(os.geteuid())}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise _refuse(setting, path, f"is in the directory {where} (mode "
                      f"{stat.S_IMODE(st.st_mode):o}), which other users can write: they can "
                      f"replace the file; run `chmod go-w {where}` or move the file")


def _walk_dirs(path: str, setting: str) -> tuple[int, str, str]:
    """The directory holding `path`'s last component, opened (O_PATH) after checking every
    directory on the way from / (`_check_dir`), following only symbolic links of root or the
    service user found in such directories. Returns (its descriptor, its name, the last name)."""
    parts = [p for p in os.path.abspath(path).split("/") if p]
    if not parts:
        raise _refuse(setting, path, "is not a regular file")
    name = parts.pop()
    fd, where = os.open("/", _PATH_FLAGS | os.O_DIRECTORY), "/"
    links = 0
    try:
        _check_dir(setting, path, where, os.fstat(fd))
        while parts:
            c = parts.pop(0)
            if c == ".":
                continue
            nxt = os.open(c, _PATH_FLAGS, dir_fd=fd)
            st = os.fstat(nxt)
            if stat.S_ISLNK(st.st_mode):
                os.close(nxt)
                links += 1
                link = os.path.join(where, c)
                if links > MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
                if not _trusted(st.st_uid):
                    raise _refuse(setting, path, f"is reached through the symbolic link {link} "
                                  f"of {_user(st.st_uid)}: they choose what it names; name the "
                                  "file itself (`readlink -f`)")
                target = os.readlink(c, dir_fd=fd)
                parts[:0] = [p for p in target.split("/") if p]
                if target.startswith("/"):
                    os.close(fd)
                    fd, where = os.open("/", _PATH_FLAGS | os.O_DIRECTORY), "/"
                continue
            os.close(fd)
            fd, where = nxt, os.path.normpath(os.path.join(where, c))
            _check_dir(setting, path, where, st)
        return fd, where, name
    except BaseException:
        os.close(fd)
        raise


def _reopen(fd: int, path: str, st: os.stat_result) -> int:
    """The checked file (an O_PATH descriptor) opened for reading: through /proc/self/fd, the
    very inode; without /proc (a bare chroot), the path again, if it is still that inode (only
    root or the service user can change the directories: `_walk_dirs`)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY
    try:
        return os.open(f"/proc/self/fd/{fd}", flags)
    except FileNotFoundError:
        rfd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
        again = os.fstat(rfd)
        if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
            os.close(rfd)
            raise OSError(errno.ESTALE, "it changed while it was checked") from None
        return rfd


def read_private_file(path: str, setting: str, max_bytes: int) -> bytes:
    """The bytes of `path`, a private file of the service user (see the module docstring).

    Args:
        path: the file, named as configured.
        setting: what named it, for the message (e.g. `offload.redis.secret_file`).
        max_bytes: the longest file accepted.

    Raises:
        ConfigError: one line: missing or unreadable, a symbolic link, in a directory another
            user can change, not a regular file, owned by another user, open to group/others,
            with another name (a hard link), or longer than max_bytes.
    """
    try:
        dfd, where, name = _walk_dirs(path, setting)
        try:
            # The file as named (the audit trail sees the configured path), opened without
            # reading (O_PATH: opening a device or a FIFO has effects); it must be the entry
            # the checked directory holds.
            fd = os.open(path, _PATH_FLAGS)
            try:
                st = os.fstat(fd)
                here = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except BaseException:
                os.close(fd)
                raise
        finally:
            os.close(dfd)
    except OSError as e:
        raise ConfigError([f"{setting}: cannot read {path}: {e.strerror or e}"]) from None
    try:
        if stat.S_ISLNK(st.st_mode):
            raise ConfigError([f"{setting}: {path} is a symbolic link; name the file itself "
                               f"(`readlink -f {path}`)"])
        if (st.st_dev, st.st_ino) != (here.st_dev, here.st_ino):
            raise _refuse(setting, path, f"changed while it was checked (in {where})")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError([f"{setting}: {path} is not a regular file"])
        if st.st_uid != os.geteuid():
            raise ConfigError([f"{setting}: {path} belongs to {_user(st.st_uid)}, not to the "
                               f"service user {_user(os.geteuid())}; another user's file is "
                               f"not a secret of ours: create it as {_user(os.geteuid())}"])
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError([f"{setting}: {path} has mode {stat.S_IMODE(st.st_mode):o}, which "
                               f"lets other users read or change it; run `chmod 600 {path}`"])
        if st.st_nlink != 1:
            raise _refuse(setting, path, f"has {st.st_nlink} names (hard links): another name "
                          "may be where other users can reach it; keep one name (copy it: "
                          f"`cp {path} NEW && chmod 600 NEW`)")
        if st.st_size > max_bytes:
            raise ConfigError([f"{setting}: {path} is {st.st_size} bytes; a file of this kind "
                               f"holds at most {max_bytes}"])
        rfd = _reopen(fd, path, st)
    except OSError as e:
        raise ConfigError([f"{setting}: cannot read {path}: {e.strerror or e}"]) from None
    finally:
        os.close(fd)
    try:
        data = b""
        while len(data) <= max_bytes:          # read to the end, never past the bound + 1
            chunk = os.read(rfd, max_bytes + 1 - len(data))
            if not chunk:
                break
            data += chunk
        if len(data) > max_bytes:              # it grew after the check
            raise ConfigError([f"{setting}: {path} is longer than {max_bytes} bytes; a file "
                               "of this kind holds at most that"])
        if len(data) != st.st_size:            # changed while read, or /proc, /sys: not a file
            raise _refuse(setting, path, f"changed while it was read ({st.st_size} bytes, "
                          f"{len(data)} read), or is not a file on disk (/proc, /sys)")
        return data
    except OSError as e:
        raise ConfigError([f"{setting}: cannot read {path}: {e.strerror or e}"]) from None
    finally:
        os.close(rfd)


def read_secret_file(path: str, setting: str, min_bytes: int = MIN_SECRET_BYTES) -> bytes:
    """The secret in `path` (`read_private_file`), stripped of surrounding whitespace.

    Args:
        path: the file.
        setting: the configuration key that named it (for the error message), e.g.
            `offload.redis.secret_file`.
        min_bytes: the shortest secret accepted (a password may be shorter than a key).

    Raises:
        ConfigError: refused by `read_private_file` (at most MAX_SECRET_BYTES), or shorter than
            min_bytes.
    """
    secret = read_private_file(path, setting, MAX_SECRET_BYTES).strip()
    if len(secret) < min_bytes:
        raise ConfigError([f"{setting}: {path} holds {len(secret)} bytes; use at least "
                           f"{min_bytes} (e.g. `openssl rand -hex 32 > {path}`)"])
    return secret


class PrivateCopy:
    """The bytes of a private file (`read_private_file`) in a memory file named by `.path`: what
    a library opens there is what was checked, whatever happens to the file afterwards."""

    def __init__(self, path: str, setting: str, max_bytes: int = MAX_SECRET_BYTES):
        data = read_private_file(path, setting, max_bytes)
        fd = os.memfd_create("sglang-offload-secret", os.MFD_CLOEXEC)
        try:
            os.write(fd, data)
        except OSError:
            os.close(fd)
            raise
        self.path = f"/proc/self/fd/{fd}"
        self._close = weakref.finalize(self, os.close, fd)

    def close(self) -> None:
        self._close()
