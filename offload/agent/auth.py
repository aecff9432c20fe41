"""The shared secret of the agent and its hosts: read from a file, else from the environment.

Primitives: `load_secret(path)` -> bytes (raises `ConfigError` naming the problem), `SECRET_ENV`
(the one environment variable for it). The file must be private to its owner (no group/other
permissions): a secret readable by everyone is no secret, so such a file is refused. Leading and
trailing whitespace is stripped; at least 16 bytes are required.
"""

from __future__ import annotations

import os
import stat

from offload.errors import ConfigError

SECRET_ENV = "SGLANG_OFFLOAD_SECRET"   # the shared secret itself (when no secret file is named)
MIN_SECRET_BYTES = 16


def load_secret(path: str | None = None, *, env: dict[str, str] | None = None) -> bytes:
    """The secret from `path` (if given) else from $SGLANG_OFFLOAD_SECRET.

    Raises:
        ConfigError: no secret, unreadable or world/group-readable file, or shorter than 16 bytes.
    """
    env = os.environ if env is None else env
    if path:
        try:
            st = os.stat(path)
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as e:
            raise ConfigError([f"agent secret file {path}: cannot read it: {e.strerror or e}"]) \
                from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError([f"agent secret file {path}: mode {stat.S_IMODE(st.st_mode):o} lets "
                               "others read it; chmod 600 it"])
        source = path
    else:
        value = env.get(SECRET_ENV, "")
        if not value:
            raise ConfigError([f"no agent secret: name a file (--secret-file / "
                               f"offload.agent.secret_file) or set ${SECRET_ENV}"])
        secret = value.strip().encode()
        source = f"${SECRET_ENV}"
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError([f"agent secret from {source} is {len(secret)} bytes; use at least "
                           f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)"])
    return secret
