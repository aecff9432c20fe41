"""The tree: one frozen dataclass per section of `offload:`, each key with its default and its doc
(the generated reference's text), and the whole deployment file.

Primitives:
- `OffloadConfig`: the `offload:` tree, its sections `StoreConfig`, `TransferConfig`,
  `AgentConfig` (with `AgentLimitsConfig`), `RedisConfig`, `HwConfig`, `MetricsConfig`,
  `WorthItConfig`. Built and checked by `offload.config.load`; never holds an unchecked value.
- `DeploymentConfig`: a whole deployment file, our `offload:` tree and SGLang's `sglang:` arguments.
- `to_dict(cfg)`: the tree as plain data (sizes as `2TiB`), for YAML/JSON output and round trips.

The sections holding secrets print them masked in their `repr` (`offload.redact`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from offload import redact
from offload.config.values import OnOffAuto, Size


def _doc(text: str, **kw: Any) -> Any:
    return field(metadata={"doc": text}, **kw)


def _redacted_repr(section: str) -> Any:
    """A dataclass __repr__ that masks the section's secrets (a repr ends up in tracebacks)."""
    def __repr__(self: Any) -> str:
        inner = ", ".join(f"{f.name}={redact.value(f'{section}.{f.name}', getattr(self, f.name))}"
                          for f in dataclasses.fields(self))
        return f"{type(self).__name__}({inner})"
    return __repr__


@dataclass(frozen=True)
class StoreConfig:
    path: str = _doc("cache directory (local NVMe); shared by every process that opens it",
                     default="/var/cache/sglang-offload")
    paths: tuple[str, ...] = _doc(
        "cache directories on several drives, one store over all (blocks spread by key, one "
        "capacity cap, a lost drive costs only its share); replaces path when set",
        default=())
    capacity: Size = _doc("one cap for the whole store (every directory of paths), all processes "
                          "together", default=Size(100 << 30))
    high_watermark: float = _doc("start evicting when use would pass this fraction of capacity",
                                 default=0.95)
    low_watermark: float = _doc("evict least-recently-used blocks down to this fraction", default=0.85)
    min_free: Size = _doc("always leave this much free on the file system", default=Size(1 << 30))
    segment_size: Size = _doc("most bytes of slots in one slab file (it grows as slots are written)",
                              default=Size(4 << 30))
    o_direct: OnOffAuto = _doc("O_DIRECT I/O: on (fail if refused), off, auto (fall back, logged)",
                               default="auto")
    io_threads: int = _doc("I/O threads per process keeping the device queue busy", default=8)
    page_cache: Size = _doc(
        "with O_DIRECT: bytes of the most recently written and read blocks left in the kernel's "
        "page cache, per open store (each drive its own), so a restarted server can read them warm; 0 = "
        "pure O_DIRECT (the default: docs/benchmarks.md, warm reads after a restart)",
        default=Size(0))
    salt: str = _doc("tenant salt mixed into every block key (isolates tenants sharing a tier); "
                     "a secret: printed as ***; a config file holding it must be mode 600",
                     default="")
    salt_file: str | None = _doc(
        "file (mode 600) holding the tenant salt, instead of salt in the config (which can then "
        "be world-readable: a ConfigMap); read where the salt is used", default=None)

    __repr__ = _redacted_repr("offload.store")

    def directories(self) -> list[str]:
        """The cache directories: `paths` when set, else the one `path`."""
        return list(self.paths) if self.paths else [self.path]


@dataclass(frozen=True)
class TransferConfig:
    path: Literal["auto", "cpu", "gds", "dpu"] = _doc(
        "how blocks move: auto (decided by detection), cpu staging, gds, dpu agent", default="auto")
    numa_node: int | None = _doc("pin I/O threads to this NUMA node (default: the GPU's); must be a "
                                 "node of the machine", default=None)
    write_budget: Size | None = _doc(
        "write-backs' share of the drive, bytes per second through the cpu path (e.g. 2GiB): a "
        "write-back batch past it is skipped, its pages not stored and counted, so reads keep the "
        "rest of the drive (unset: no cap; the write lane's queue bound still holds)", default=None)


@dataclass(frozen=True)
class AgentLimitsConfig:
    """What `sglang-offload agent` allows (read by the agent, `--config FILE`; each key is the
    flag of the same name, which wins over it)."""

    max_clients: int = _doc("authenticated connections at once, per host key of the keys file (in "
                            "all with a shared secret); --max-clients", default=64)
    max_pending: int = _doc("connections still authenticating at once (more are closed at accept); "
                            "--max-pending", default=16)
    max_requests: int = _doc("requests in progress at once, per host key; --max-requests",
                             default=32)
    max_namespaces: int = _doc("namespaces registered at once, per host key; --max-namespaces",
                               default=1024)
    max_frame: Size = _doc("largest request or reply frame, 1MiB..4GiB (64KiB before a verified "
                           "HELLO); --max-frame", default=Size(64 << 20))
    staging: Size = _doc("staging memory per NIXL connection, two halves (the largest block is "
                         "half of it), at least 1MiB; --staging", default=Size(64 << 20))
    max_quarantine: Size = _doc("memory that transfers past their deadline may hold, per host key; "
                                "--max-quarantine", default=Size(256 << 20))
    max_memory: Size = _doc("memory held for all connections together (request frames, "
                            "replies, staging, announced pages); --max-memory",
                            default=Size(4 << 30))
    max_memory_per_key: Size = _doc("memory held for one host key's connections (request "
                                    "frames, replies, staging, announced pages); "
                                    "--max-memory-per-key", default=Size(1 << 30))
    io_timeout: float = _doc("seconds a started frame (and the whole handshake) may take; "
                             "--io-timeout", default=30.0)
    idle_timeout: float = _doc("seconds an authenticated connection may wait with no request; "
                               "--idle-timeout", default=3600.0)


@dataclass(frozen=True)
class AgentConfig:
    address: str | None = _doc("HOST:PORT of the DPU / storage agent", default=None)
    transport: Literal["ucx", "tcp"] = _doc("ucx (NIXL moves the bytes) or tcp (bytes on the "
                                            "control connection)", default="ucx")
    secret_file: str | None = _doc("file (mode 600) holding the shared secret (else env "
                                   "SGLANG_OFFLOAD_SECRET)", default=None)
    host_name: str | None = _doc("this host's name in the agent's keys file (per-host credentials; "
                                 "secret_file then holds this host's own secret)", default=None)
    timeout_s: float = _doc("give up on one call (waiting for a connection, connecting and "
                            "its requests together) after this many seconds", default=5.0)
    limits: AgentLimitsConfig = field(default_factory=AgentLimitsConfig)


@dataclass(frozen=True)
class RedisConfig:
    url: str | None = _doc("redis://, rediss:// (TLS) or redis+cluster:// URL; unset = no Redis tier; "
                           "a password in it is printed as ***", default=None)
    write_policy: Literal["write_through", "seen_n"] = _doc(
        "write every block to Redis, or only blocks stored seen_n times", default="write_through")
    seen_n: int = _doc("with write_policy seen_n: how many stores before a block goes to Redis",
                       default=2)
    timeout_s: float = _doc("no request waits on Redis longer than this", default=0.5)
    backoff_s: float = _doc("after a failure, skip Redis for this long before reconnecting",
                            default=5.0)
    ttl_s: int | None = _doc("expire blocks after this many seconds (unset: rely on maxmemory)",
                             default=None)
    max_bytes: Size | None = _doc("our own budget in Redis (unset: Redis's maxmemory decides)",
                                  default=None)
    password_file: str | None = _doc("file (mode 600) holding the Redis AUTH password (wins over one "
                                     "in the URL)", default=None)
    secret_file: str | None = _doc(
        "file (mode 600, >= 16 bytes) holding the key that authenticates every value in Redis; "
        "unset: values are bound to their key but anyone who can write to the Redis can forge "
        "them (a warning is logged)", default=None)
    key_prefix: str = _doc("first part of every Redis key we use (`PREFIX:v2:...`): one per "
                           "tenant, for ACLs (`~PREFIX:*`) and a confined `cache clear`",
                           default="sglo")
    tls_ca_file: str | None = _doc("rediss://: CA bundle that signed the server certificate "
                                   "(unset: the system store)", default=None)
    tls_cert_file: str | None = _doc("rediss://: client certificate (servers with "
                                     "tls-auth-clients yes)", default=None)
    tls_key_file: str | None = _doc("rediss://: private key of tls_cert_file", default=None)

    __repr__ = _redacted_repr("offload.redis")


@dataclass(frozen=True)
class HwConfig:
    dpu_mode: Literal["auto", "dpu", "nic"] = _doc(
        "operator override of the BlueField mode (wins over detection)", default="auto")


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = _doc("export Prometheus metrics", default=True)
    port: int | None = _doc("also serve metrics on this port, 1..65535 (SGLang's own /metrics has "
                            "them with --enable-metrics; without it, each rank on port + rank)",
                            default=None)


@dataclass(frozen=True)
class WorthItConfig:
    enabled: bool = _doc("skip loads that would take longer than recomputing", default=True)
    prefill_tokens_per_s: float | None = _doc(
        "prefill tokens/s of one replica (all TP ranks); unset = the plan module's estimate "
        "from the model and GPU, else measured from the first requests (any device)",
        default=None)
    max_prefetch_wait_s: float = _doc(
        "the longest a request waits for its L3 prefetch (launch's SGLang deadline: no longer "
        "than recomputing the prompt would take, and never past this); then it goes on with "
        "what has loaded and computes the rest", default=30.0)


@dataclass(frozen=True)
class OffloadConfig:
    store: StoreConfig = field(default_factory=StoreConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    hw: HwConfig = field(default_factory=HwConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    worth_it: WorthItConfig = field(default_factory=WorthItConfig)


@dataclass(frozen=True)
class DeploymentConfig:
    """A whole deployment file: our `offload:` section and SGLang's own `sglang:` arguments."""

    offload: OffloadConfig = field(default_factory=OffloadConfig)
    sglang: Mapping[str, Any] = field(default_factory=dict)


def to_dict(cfg: Any) -> Any:
    """Plain data (sizes as strings like `2TiB`), suitable for YAML/JSON output and round trips."""
    if dataclasses.is_dataclass(cfg):
        out = {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
        if isinstance(cfg, StoreConfig) and cfg.paths:
            del out["path"]         # replaced by paths; a file with both is refused (load.py)
        return out
    if isinstance(cfg, Size):
        return str(cfg)
    if isinstance(cfg, Mapping):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, tuple):
        return [to_dict(v) for v in cfg]
    return cfg
