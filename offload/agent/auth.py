"""Agent credentials: one shared secret (one trusted host group), or a keys file of per-host secrets.

Primitives: `load_secret(path)` -> bytes (raises `ConfigError` naming the problem), `SECRET_ENV`
(the one environment variable for it); `load_keys(path)` -> {host name: `HostKey`} from a TOML
keys file (`docs/deploy/agent.md#per-host-credentials`):

    [hosts.node-a]
    secret = "<at least 16 bytes, e.g. openssl rand -hex 32>"
    namespaces = ["*"]                 # every namespace, or 32-hex-digit namespace digests
    salts = ["tenant-a-salt"]          # and/or: namespaces made with one of these tenant salts

Both files are read by the one loader of secret files (`offload.secret`: owned by the
service user, not a symbolic link, private, a regular file, bounded in size; each refusal one
line naming the file and why). Secrets are stripped of surrounding whitespace and need at least
16 bytes; two hosts may not share a secret (either could act as the other).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass

from offload.errors import ConfigError
from offload.secret import MAX_KEYS_FILE_BYTES, MIN_SECRET_BYTES, read_private_file, read_secret_file

SECRET_ENV = "SGLANG_OFFLOAD_SECRET"   # the shared secret itself (when no secret file is named)


def load_secret(path: str | None = None, *, env: Mapping[str, str] | None = None) -> bytes:
    """The secret from `path` (if given) else from $SGLANG_OFFLOAD_SECRET.

    Raises:
        ConfigError: no secret, a file the loader refuses (`offload.secret`), or shorter
            than 16 bytes.
    """
    env = os.environ if env is None else env
    if path:
        return read_secret_file(path, "agent secret file")
    value = env.get(SECRET_ENV, "")
    if not value:
        raise ConfigError([f"no agent secret: name a file (--secret-file / "
                           f"offload.agent.secret_file) or set ${SECRET_ENV}"])
    secret = value.strip().encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError([f"agent secret from ${SECRET_ENV} is {len(secret)} bytes; use at least "
                           f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)"])
    return secret


HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@:-]{0,127}$")   # = protocol.HOST_PATTERN
_DIGEST_RE = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class HostKey:
    """One host's credential and what it may use."""
    name: str
    secret: bytes
    namespaces: frozenset[bytes] | None      # None: every namespace
    salts: tuple[str, ...] = ()


def load_keys(path: str) -> dict[str, HostKey]:
    """The agent's keys file (TOML, mode 600). Raises ConfigError naming each problem."""
    raw = read_private_file(path, "agent keys file", MAX_KEYS_FILE_BYTES)
    try:
        doc = tomllib.loads(raw.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError([f"agent keys file {path}: not TOML: {e}"]) from None
    problems: list[str] = []
    unknown = set(doc) - {"hosts"}
    if unknown:
        problems.append(f"{path}: unknown top-level keys {sorted(unknown)}; only [hosts.NAME]")
    hosts = doc.get("hosts", {})
    if not isinstance(hosts, dict) or not hosts:
        problems.append(f"{path}: no [hosts.NAME] tables")
        hosts = {}
    out: dict[str, HostKey] = {}
    seen: dict[bytes, str] = {}
    for name, entry in hosts.items():
        where = f"{path}: hosts.{name}"
        if not HOST_RE.match(name):
            problems.append(f"{where}: host names are letters, digits and . _ @ : - (up to 128)")
            continue
        if not isinstance(entry, dict) or set(entry) - {"secret", "namespaces", "salts"}:
            problems.append(f"{where}: allowed keys are secret, namespaces, salts")
            continue
        raw = entry.get("secret", "")
        secret = raw.strip().encode() if isinstance(raw, str) else b""
        if not isinstance(raw, str):     # a number or a list's repr is no secret anyone chose
            problems.append(f"{where}.secret: a {type(raw).__name__}; write the secret as a "
                            "quoted string (e.g. the output of `openssl rand -hex 32`)")
        elif len(secret) < MIN_SECRET_BYTES:
            problems.append(f"{where}.secret: {len(secret)} bytes; use at least "
                            f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)")
        elif secret in seen:
            problems.append(f"{where}.secret: the same as hosts.{seen[secret]}'s; each host needs "
                            "its own")
        seen[secret] = name
        names = entry.get("namespaces", [])
        salts = entry.get("salts", [])
        if not isinstance(names, list) or not isinstance(salts, list) or \
                not all(isinstance(x, str) for x in names + salts):
            problems.append(f"{where}: namespaces and salts are lists of strings")
            continue
        bad = [x for x in names if x != "*" and not _DIGEST_RE.match(x)]
        if bad:
            problems.append(f"{where}.namespaces: {bad} are not \"*\" or 32 lowercase hex digits "
                            "(`sglang-offload cache stats` shows each namespace's digest)")
        if not names and not salts:
            problems.append(f"{where}: grants nothing; list namespaces (or \"*\") and/or salts")
        grant = None if "*" in names else frozenset(bytes.fromhex(x) for x in names
                                                    if _DIGEST_RE.match(x))
        out[name] = HostKey(name, secret, grant, tuple(salts))
    if problems:
        raise ConfigError(problems)
    return out
