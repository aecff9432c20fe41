"""How often the agent challenges NIXL endpoints for a tenant: token buckets, per key and per
(key, target endpoint).

Each METADATA (and a HELLO with metadata) makes the agent send a fresh nonce to the endpoint the
metadata names (`offload.agent.mover.Mover.challenge`). Unbounded, one tenant sending METADATA in
a loop had the agent send 44k-90k notifications in 15 s to a victim's endpoint (its metadata
replayed under the tenant's own name), whose process keeps every one. Now a challenge takes a
token from its key's bucket and from the bucket of (key, endpoint): past them the request gets
an ERROR reply and nothing is sent or loaded, so a flood costs the flooder (its own proofs wait)
and never the endpoint's owner (whose key has its own buckets).

Primitives: `Challenges(per_key=, key_rate=, per_endpoint=, endpoint_rate=, clock=)`;
`.take(key, endpoint)` -> None or why not. The endpoint is the UCX worker address the metadata
carries (`endpoint_of`), not the name (a replay renames). Bounded: at most `MAX_ENDPOINTS`
(key, endpoint) buckets, the least recently used forgotten first (a forgotten bucket is full
again: at most its burst more).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from typing import Callable

from offload.agent.vet import worker_address

PER_KEY = 64                # challenges one key may send at once (a reconnect of 8 ranks x 2
                            # connections, each re-registering a few regions)
KEY_RATE = 8.0              # ... and per second after that
PER_ENDPOINT = 16           # challenges one key may send to one endpoint at once
ENDPOINT_RATE = 1.0         # ... and per second after that
MAX_ENDPOINTS = 4096        # (key, endpoint) buckets kept


def endpoint_of(md: bytes) -> bytes:
    """A digest of the UCX worker address in NIXL metadata (of the whole blob if none found)."""
    return hashlib.sha256(worker_address(md) or md).digest()[:16]


class _Bucket:
    __slots__ = ("tokens", "at")

    def __init__(self, tokens: float, at: float):
        self.tokens, self.at = tokens, at

    def take(self, burst: int, rate: float, now: float) -> bool:
        self.tokens = min(float(burst), self.tokens + (now - self.at) * rate)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class Challenges:
    def __init__(self, per_key: int = PER_KEY, key_rate: float = KEY_RATE,
                 per_endpoint: int = PER_ENDPOINT, endpoint_rate: float = ENDPOINT_RATE,
                 clock: Callable[[], float] = time.monotonic):
        self.per_key, self.key_rate = per_key, key_rate
        self.per_endpoint, self.endpoint_rate = per_endpoint, endpoint_rate
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: dict[str, _Bucket] = {}
        self._ends: OrderedDict[tuple[str, bytes], _Bucket] = OrderedDict()

    def take(self, key: str, endpoint: bytes) -> str | None:
        """A token for one challenge of `key` to `endpoint`, or why not (none taken then)."""
        now = self._clock()
        with self._lock:
            kb = self._keys.setdefault(key, _Bucket(float(self.per_key), now))
            eb = self._ends.get((key, endpoint))
            if eb is None:
                eb = self._ends[(key, endpoint)] = _Bucket(float(self.per_endpoint), now)
                while len(self._ends) > MAX_ENDPOINTS:
                    self._ends.popitem(last=False)
            self._ends.move_to_end((key, endpoint))
            if not eb.take(self.per_endpoint, self.endpoint_rate, now):
                return (f"too many NIXL challenges to one endpoint for this host key (at most "
                        f"{self.per_endpoint}, then {self.endpoint_rate:g}/s); retry later")
            if not kb.take(self.per_key, self.key_rate, now):
                eb.tokens += 1.0
                return (f"too many NIXL challenges for this host key (at most {self.per_key}, "
                        f"then {self.key_rate:g}/s); retry later")
            return None
