"""Who may connect to the agent and which namespaces each host may use.

Primitives: `Access.shared(secret)` (one secret: every holder is one trusted host group and may use
every namespace) or `Access.per_host(keys)` (a keys file, `offload.agent.auth.load_keys`);
`.secret(host)` -> the host's secret or None (unknown host); `.register(host, msg)` -> the
`Namespace` (recorded for the host; described to the store once a block of it is stored), once
the host is entitled to the namespace digest it registered (raises `AccessError`);
`.namespace(host, digest)` -> that record or None; `.refused(host, keys)` -> None when every
key's namespace is the host's, else the reason.

A host is entitled to a namespace digest listed for it in the keys file, or to one it registered
(REGISTER_NS: the descriptive fields and the digest, never the salt) whose digest the agent
recomputes from those fields and one of the host's tenant salts.

Quotas, per tenant: a host key of the keys file (with one shared secret every holder is one
tenant, "*"), so that a table full for one tenant never refuses another. `.connect(host)` ->
None or why not (at most `max_conns` connections), `.disconnect(host)`; `.begin(host)` -> None or
why not (at most `max_requests` requests in progress), `.end(host)`; at most `max_namespaces`
registered namespaces. A host's registrations expire when its last connection closes (its
client registers them again on reconnecting; the store keeps the description of a namespace it
holds blocks of).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from typing import Sequence

from offload.agent import protocol
from offload.agent.auth import HostKey
from offload.keys import NS_BYTES, Namespace

MAX_PER_TENANT = 1024          # registered namespaces per host key (or per shared secret)
MAX_CONNS = 64                 # connections per host key (or in all, with a shared secret)
MAX_REQUESTS = 32              # requests in progress per host key (or in all)
SHARED = "*"                   # the one tenant of a shared secret


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
    def __init__(self, shared: bytes | None, keys: dict[str, HostKey] | None, *,
                 max_conns: int = MAX_CONNS, max_requests: int = MAX_REQUESTS,
                 max_namespaces: int = MAX_PER_TENANT):
        self._shared = shared
        self._keys = keys or {}
        self.max_conns = max_conns
        self.max_requests = max_requests
        self.max_namespaces = max_namespaces
        self._lock = threading.Lock()
        # host -> namespace digest -> what it registered (copy-on-write: read without lock)
        self._registered: dict[str, dict[bytes, Namespace]] = {}
        self._ns = Counter[str]()        # per tenant: registered namespaces
        self._conns = Counter[str]()     # per tenant: open connections
        self._hosts = Counter[str]()     # per host: open connections
        self._requests = Counter[str]()  # per tenant: requests in progress

    @classmethod
    def shared(cls, secret: bytes, **quotas: int) -> "Access":
        return cls(secret, None, **quotas)

    @classmethod
    def per_host(cls, keys: dict[str, HostKey], **quotas: int) -> "Access":
        return cls(None, keys, **quotas)

    @property
    def mode(self) -> str:
        return "shared secret" if self._shared is not None else f"keys file ({len(self._keys)} hosts)"

    def secret(self, host: str) -> bytes | None:
        if self._shared is not None:
            return self._shared
        key = self._keys.get(host)
        return key.secret if key is not None else None

    def tenant(self, host: str) -> str:
        """The quota holder: the host's key, or the one tenant of a shared secret."""
        return SHARED if self._shared is not None else host

    # ---------------------------------------------------------------- quotas
    def _take(self, table: Counter[str], tenant: str, limit: int, what: str, state: str
              ) -> str | None:
        """One more of `tenant`'s `what` in `table` (lock held); None, or why not."""
        if table[tenant] >= limit:
            return f"{limit} {what} of {self._who(tenant)} {state} already"
        table[tenant] += 1
        return None

    @staticmethod
    def _give(table: Counter[str], tenant: str, n: int = 1) -> None:
        table[tenant] -= n
        if table[tenant] <= 0:
            del table[tenant]

    def connect(self, host: str) -> str | None:
        """Count one more connection of `host`; None, or why it is refused."""
        with self._lock:
            why = self._take(self._conns, self.tenant(host), self.max_conns, "connections",
                             "open")
            if why is None:
                self._hosts[host] += 1
            return why

    def disconnect(self, host: str) -> None:
        """A connection of `host` closed; with its last, its registrations expire."""
        t = self.tenant(host)
        with self._lock:
            self._give(self._conns, t)
            self._give(self._hosts, host)
            if host not in self._hosts:
                self._give(self._ns, t, len(self._registered.pop(host, {})))

    def begin(self, host: str) -> str | None:
        """One more request of `host` in progress; None, or why it is refused."""
        with self._lock:
            return self._take(self._requests, self.tenant(host), self.max_requests, "requests",
                              "in progress")

    def end(self, host: str) -> None:
        with self._lock:
            self._give(self._requests, self.tenant(host))

    def usage(self) -> dict[str, int]:
        """Totals over tenants (for STATS; no tenant is named)."""
        with self._lock:
            return {"tenants": len(self._conns), "namespaces": sum(self._ns.values()),
                    "requests": sum(self._requests.values())}

    @staticmethod
    def _who(tenant: str) -> str:
        return "the shared secret's hosts" if tenant == SHARED else f"host {tenant!r}"

    # ---------------------------------------------------------------- namespaces
    def register(self, host: str, msg: protocol.RegisterNs) -> Namespace:
        """Check that `host` may use the namespace, record it (bounded); returns it."""
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
        ns = RemoteNamespace(**{**dataclasses.asdict(_fields(msg, "set" if msg.salted else "")),
                                "ns_digest": digest})
        t = self.tenant(host)
        with self._lock:
            mine = self._registered.get(host, {})
            if digest not in mine:
                if self._ns[t] >= self.max_namespaces:
                    raise AccessError(f"{self._who(t)} registered {self.max_namespaces} "
                                      "namespaces already (they expire when its connections "
                                      "close)")
                self._ns[t] += 1
            self._registered[host] = {**mine, digest: ns}
        return ns

    def namespace(self, host: str, digest: bytes) -> Namespace | None:
        """What `host` registered under `digest`, if it did (while connected)."""
        return self._registered.get(host, {}).get(bytes(digest))

    def refused(self, host: str, keys: Sequence[bytes]) -> str | None:
        """None if `host` may use every key's namespace, else why not."""
        if self._shared is not None:
            return None
        key = self._keys.get(host)
        if key is None:
            return f"unknown host {host!r}"
        if key.namespaces is None:
            return None
        mine = self._registered.get(host, {})
        for k in keys:
            ns = k[:NS_BYTES]
            if ns not in mine and ns not in key.namespaces:
                return (f"namespace {bytes(ns).hex()} is not granted to host {host!r} (register "
                        "it first, with a salt or digest its keys file entry lists)")
        return None
