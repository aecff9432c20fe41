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
endpoint buckets per key. Only a request granted a token creates a bucket (before, a refused
one did, and least-recently-used eviction let junk push a victim's bucket out so that it came
back full: 96 nonces to one endpoint in 20 s), and only a bucket that is full again is ever
forgotten (as if it were new), so 16 + 1/s per (key, endpoint) holds exactly; a key whose
`MAX_ENDPOINTS` buckets are all still refilling is refused a new endpoint (the key's own
requests: it made them; its rate, 64 + 8/s, keeps at most about 200 non-full at once).
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Callable

from offload.agent.vet import worker_address

PER_KEY = 64                # challenges one key may send at once (a reconnect of 8 ranks x 2
                            # connections, each re-registering a few regions)
KEY_RATE = 8.0              # ... and per second after that
PER_ENDPOINT = 16           # challenges one key may send to one endpoint at once
ENDPOINT_RATE = 1.0         # ... and per second after that
MAX_ENDPOINTS = 4096        # (key, endpoint) buckets kept per key


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
                 clock: Callable[[], float] = time.monotonic, max_endpoints: int = MAX_ENDPOINTS):
        self.per_key, self.key_rate = per_key, key_rate
        self.per_endpoint, self.endpoint_rate = per_endpoint, endpoint_rate
        self.max_endpoints = max_endpoints
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: dict[str, _Bucket] = {}
        self._ends: dict[str, dict[bytes, _Bucket]] = {}     # key -> endpoint -> bucket

    def take(self, key: str, endpoint: bytes) -> str | None:
        """A token for one challenge of `key` to `endpoint`, or why not (none taken then, and no
        bucket created: a refused request leaves no trace that could push another bucket out)."""
        now = self._clock()
        with self._lock:
            kb = self._keys.get(key) or _Bucket(float(self.per_key), now)
            ends = self._ends.get(key, {})
            eb = ends.get(endpoint)
            new = eb is None
            if eb is None:
                eb = _Bucket(float(self.per_endpoint), now)
            if not eb.take(self.per_endpoint, self.endpoint_rate, now):
                return (f"too many NIXL challenges to one endpoint for this host key (at most "
                        f"{self.per_endpoint}, then {self.endpoint_rate:g}/s); retry later")
            if not kb.take(self.per_key, self.key_rate, now):
                eb.tokens += 1.0
                return (f"too many NIXL challenges for this host key (at most {self.per_key}, "
                        f"then {self.key_rate:g}/s); retry later")
            if new and len(ends) >= self.max_endpoints and not self._sweep(ends, now):
                kb.tokens += 1.0
                return (f"this host key challenges {len(ends)} NIXL endpoints that were "
                        "challenged recently; retry later")
            self._keys[key] = kb
            if new:
                ends[endpoint] = eb
                self._ends[key] = ends
            return None

    def _sweep(self, ends: dict[bytes, _Bucket], now: float) -> bool:
        """Forget the buckets that are full again (forgetting them changes nothing: a new one
        starts full); whether one went. A bucket that is not full is never forgotten."""
        full = [e for e, b in ends.items()
                if b.tokens + (now - b.at) * self.endpoint_rate >= self.per_endpoint]
        for e in full:
            del ends[e]
        return bool(full)

    def buckets(self, key: str) -> int:
        """(key, endpoint) buckets kept for `key`."""
        with self._lock:
            return len(self._ends.get(key, ()))
