"""Deployment secrets read from files: the ONE loader for every secret the service keeps in a file.

Every secret or key file is read here, by the Redis tier (`redis.secret_file`,
`redis.password_file`), the agent and its clients (`agent.secret_file`, the agent's keys file)
and the checks before start (`config validate`, `detect`, `launch`); nothing else opens one
(tests/store/test_secret_files.py walks the sources for other readers).

Primitives:
- `read_private_file(path, setting, max_bytes)` -> the file's bytes. The file is accepted only
  if it is, as opened (no check-then-open race: every check is on the open descriptor):
  not a symbolic link (`O_NOFOLLOW`: a link lets whoever can write its directory choose what we
  read), a regular file, owned by the service user (the effective uid: a file another user
  planted first, even mode 600, is theirs and its secret is known to them), private (no
  group/other permission bits, as ssh refuses a private key), and at most `max_bytes` long.
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


def read_private_file(path: str, setting: str, max_bytes: int) -> bytes:
    """The bytes of `path`, a private file of the service user (see the module docstring).

    Args:
        path: the file, named as configured.
        setting: what named it, for the message (e.g. `offload.redis.secret_file`).
        max_bytes: the longest file accepted.

    Raises:
        ConfigError: one line: missing or unreadable, a symbolic link, not a regular file, owned
            by another user, open to group/others, or longer than max_bytes.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ConfigError([f"{setting}: {path} is a symbolic link; name the file itself "
                               f"(`readlink -f {path}`)"]) from None
        raise ConfigError([f"{setting}: cannot read {path}: {e.strerror or e}"]) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError([f"{setting}: {path} is not a regular file"])
        if st.st_uid != os.geteuid():
            raise ConfigError([f"{setting}: {path} belongs to {_user(st.st_uid)}, not to the "
                               f"service user {_user(os.geteuid())}; another user's file is "
                               f"not a secret of ours: create it as {_user(os.geteuid())}"])
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError([f"{setting}: {path} has mode {stat.S_IMODE(st.st_mode):o}, which "
                               f"lets other users read or change it; run `chmod 600 {path}`"])
        if st.st_size > max_bytes:
            raise ConfigError([f"{setting}: {path} is {st.st_size} bytes; a file of this kind "
                               f"holds at most {max_bytes}"])
        data = b""
        while len(data) <= max_bytes:          # read to the end, never past the bound + 1
            chunk = os.read(fd, max_bytes + 1 - len(data))
            if not chunk:
                break
            data += chunk
        if len(data) > max_bytes:              # it grew after the check
            raise ConfigError([f"{setting}: {path} is longer than {max_bytes} bytes; a file "
                               "of this kind holds at most that"])
        return data
    except OSError as e:
        raise ConfigError([f"{setting}: cannot read {path}: {e.strerror or e}"]) from None
    finally:
        os.close(fd)


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
