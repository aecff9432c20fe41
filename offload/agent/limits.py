"""The agent's limits, one value: what `AgentServer` is given instead of a parameter each.

Primitives: `AgentLimits(...)`, frozen; every field has the default of its `sglang-offload agent`
flag and config key (docs/deploy/agent.md#limits; each bound with its number:
docs/security/agent.md); `AgentLimits.from_config(cfg)` -> the limits of the validated
`offload.agent.limits` section (`offload.config.AgentLimitsConfig`, which the command builds
from its file and flags); `.max_block` -> the largest block (half the staging, within a frame).
The constants of the modules that enforce other bounds (challenges, metadata, hidden keys) are
listed there too.
"""

from __future__ import annotations

from dataclasses import dataclass

from offload.agent.budget import MAX_MEMORY, MAX_MEMORY_PER_KEY
from offload.agent.protocol import DEFAULT_MAX_BODY
from offload.config import AgentLimitsConfig


@dataclass(frozen=True)
class AgentLimits:
    max_clients: int = 64              # authenticated connections per host key
    max_pending: int = 16              # connections still authenticating, in all
    max_requests: int = 32             # requests in progress per host key
    max_namespaces: int = 1024         # registered namespaces (and descriptions) per host key
    max_body: int = DEFAULT_MAX_BODY   # bytes of one frame
    staging_size: int = 64 << 20       # staging memory per NIXL connection (two halves)
    max_quarantine: int = 256 << 20    # bytes transfers past their deadline hold, per host key
    max_memory: int = MAX_MEMORY       # frames + staging of all connections
    max_memory_per_key: int = MAX_MEMORY_PER_KEY   # ... of one host key's connections
    io_timeout: float = 30.0           # a started frame (and the handshake) in all
    idle_timeout: float = 3600.0       # an authenticated connection with no request

    def __post_init__(self) -> None:
        # Plain numbers (a CLI `Size` is an int subclass the wire encoder does not take).
        for f in ("max_clients", "max_pending", "max_requests", "max_namespaces", "max_body",
                  "staging_size", "max_quarantine", "max_memory", "max_memory_per_key"):
            object.__setattr__(self, f, int(getattr(self, f)))
        for f in ("io_timeout", "idle_timeout"):
            object.__setattr__(self, f, float(getattr(self, f)))

    @classmethod
    def from_config(cls, c: AgentLimitsConfig) -> "AgentLimits":
        return cls(max_clients=c.max_clients, max_pending=c.max_pending,
                   max_requests=c.max_requests, max_namespaces=c.max_namespaces,
                   max_body=c.max_frame, staging_size=c.staging, max_quarantine=c.max_quarantine,
                   max_memory=c.max_memory, max_memory_per_key=c.max_memory_per_key,
                   io_timeout=c.io_timeout, idle_timeout=c.idle_timeout)

    @property
    def max_block(self) -> int:
        return min(self.staging_size // 2, self.max_body - (1 << 16))
