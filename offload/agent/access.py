"""Who may connect to the agent and which namespaces each host may use.

Primitives: `Access.shared(secret)` (one secret: every holder is one trusted host group and may use
every namespace) or `Access.per_host(keys)` (a keys file, `offload.agent.auth.load_keys`);
`.secret(host)` -> the host's secret or None (unknown host); `.register(host, msg)` -> the
`Namespace` to record in the store, once the host is entitled to the namespace digest it
registered (raises `AccessError`); `.refused(host, keys)` -> None when every key's namespace is
the host's, else the reason.

A host is entitled to a namespace digest listed for it in the keys file, or to one it registered
(REGISTER_NS: the descriptive fields and the digest, never the salt) whose digest the agent
recomputes from those fields and one of the host's tenant salts. Registered namespaces are
bounded per host (`MAX_PER_HOST`) and in total (`MAX_TOTAL`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Sequence

from offload.agent import protocol
from offload.agent.auth import HostKey
from offload.keys import NS_BYTES, Namespace

MAX_PER_HOST = 1024
MAX_TOTAL = 16384


class AccessError(Exception):
    """A host asked for something its credential does not grant."""


@dataclasses.dataclass(frozen=True)
class RemoteNamespace(Namespace):
    """A namespace as a host described it: its digest, and whether a salt is set (never which)."""
    ns_digest: bytes = b""

    def digest(self) -> bytes:
        return self.ns_digest

    def describe(self) -> dict[str, object]:
        d = super().describe()
        d.pop("ns_digest", None)
        return d


# The fields a host describes a namespace by: all of `Namespace` but the salt.
DESCRIBED = tuple(f.name for f in dataclasses.fields(Namespace) if f.name != "salt")


def _fields(msg: protocol.RegisterNs, salt: str) -> Namespace:
    return Namespace(salt=salt, **{f: getattr(msg, f) for f in DESCRIBED})


def register_msg(ns: Namespace) -> protocol.RegisterNs:
    """What a host sends for a namespace (client side): no salt."""
    return protocol.RegisterNs(digest=ns.digest(), salted=bool(ns.salt),
                               **{f: getattr(ns, f) for f in DESCRIBED})


class Access:
    def __init__(self, shared: bytes | None, keys: dict[str, HostKey] | None):
        self._shared = shared
        self._keys = keys or {}
        self._lock = threading.Lock()
        # host -> namespace digests it registered (copy-on-write frozensets: read without lock)
        self._registered: dict[str, frozenset[bytes]] = {}
        self._total: set[bytes] = set()

    @classmethod
    def shared(cls, secret: bytes) -> "Access":
        return cls(secret, None)

    @classmethod
    def per_host(cls, keys: dict[str, HostKey]) -> "Access":
        return cls(None, keys)

    @property
    def mode(self) -> str:
        return "shared secret" if self._shared is not None else f"keys file ({len(self._keys)} hosts)"

    def secret(self, host: str) -> bytes | None:
        if self._shared is not None:
            return self._shared
        key = self._keys.get(host)
        return key.secret if key is not None else None

    def register(self, host: str, msg: protocol.RegisterNs) -> Namespace:
        """Check that `host` may use the namespace, record it (bounded); returns it for the store."""
        digest = bytes(msg.digest)
        key = self._keys.get(host)
        if self._shared is not None or (key is not None and key.namespaces is None):
            if not msg.salted and _fields(msg, "").digest() != digest:
                raise AccessError("the digest does not match the namespace's fields")
        elif key is None:
            raise AccessError(f"unknown host {host!r}")
        elif digest not in key.namespaces and not any(    # type: ignore[operator]
                _fields(msg, s).digest() == digest for s in key.salts):
            raise AccessError(f"namespace {digest.hex()} is not granted to host {host!r} "
                              "(its keys file entry lists neither the digest nor its salt)")
        with self._lock:
            mine = self._registered.get(host, frozenset())
            if digest not in mine:
                if len(mine) >= MAX_PER_HOST:
                    raise AccessError(f"host {host!r} registered {MAX_PER_HOST} namespaces already")
                if digest not in self._total and len(self._total) >= MAX_TOTAL:
                    raise AccessError(f"the agent holds {MAX_TOTAL} namespaces already")
                self._registered[host] = mine | {digest}
                self._total.add(digest)
        return RemoteNamespace(**{**dataclasses.asdict(_fields(msg, "set" if msg.salted else "")),
                                  "ns_digest": digest})

    def refused(self, host: str, keys: Sequence[bytes]) -> str | None:
        """None if `host` may use every key's namespace, else why not."""
        if self._shared is not None:
            return None
        key = self._keys.get(host)
        if key is None:
            return f"unknown host {host!r}"
        if key.namespaces is None:
            return None
        mine = self._registered.get(host, frozenset())
        for k in keys:
            ns = k[:NS_BYTES]
            if ns not in mine and ns not in key.namespaces:
                return (f"namespace {bytes(ns).hex()} is not granted to host {host!r} (register "
                        "it first, with a salt or digest its keys file entry lists)")
        return None
