"""Deployment secrets read from files: one loader for every secret the service keeps in a file.

Primitives: `read_secret_file(path, setting)` -> bytes, `MIN_SECRET_BYTES`. The file must be a
regular file private to its owner (no group/other permission bits: a secret others can read is
no secret, so such a file is refused, as ssh refuses a private key), and hold at least 16 bytes
once leading and trailing whitespace is stripped. Symbolic links are followed (Kubernetes mounts
secrets through them); the mode checked is the target's. Every refusal is a `ConfigError`
naming the setting, the file and the fix. Used by the Redis tier (`offload.redis.secret_file`);
it imports nothing of the agent package, so the agent can use it too.
"""

from __future__ import annotations

import os
import stat

from offload.errors import ConfigError

MIN_SECRET_BYTES = 16


def read_secret_file(path: str, setting: str, min_bytes: int = MIN_SECRET_BYTES) -> bytes:
    """The secret in `path`, stripped of surrounding whitespace.

    Args:
        path: the file.
        setting: the configuration key that named it (for the error message), e.g.
            `offload.redis.secret_file`.
        min_bytes: the shortest secret accepted (a password may be shorter than a key).

    Raises:
        ConfigError: unreadable, not a regular file, readable or writable by group/others, or
            shorter than min_bytes.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as e:
        raise ConfigError([f"{setting}: cannot read {path}: {e.strerror or e}"]) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError([f"{setting}: {path} is not a regular file"])
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError([f"{setting}: {path} has mode {stat.S_IMODE(st.st_mode):o}, which "
                               f"lets other users read or change it; run `chmod 600 {path}`"])
        with os.fdopen(os.dup(fd), "rb") as f:
            secret = f.read(1 << 16).strip()
    except OSError as e:
        raise ConfigError([f"{setting}: cannot read {path}: {e.strerror or e}"]) from None
    finally:
        os.close(fd)
    if len(secret) < min_bytes:
        raise ConfigError([f"{setting}: {path} holds {len(secret)} bytes; use at least "
                           f"{min_bytes} (e.g. `openssl rand -hex 32 > {path}`)"])
    return secret
