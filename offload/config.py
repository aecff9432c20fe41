"""One validated configuration tree.

Primitives: frozen dataclasses (`OffloadConfig` and its sections) built by `load_offload(dict)`,
`load_file(path)` and `load_text(str)`. Every problem found is reported at once as a `ConfigError`
whose lines name the YAML key path, the bad value and what is allowed. Unknown keys are errors.
Sizes accept plain bytes or a number with a unit (`512MiB`, `2TiB`, `1.5GB`).

`parse_url(url)` -> `RedisTarget`: the grammar of `offload.redis.url` (standalone or cluster, TLS or
not, nodes, db, credentials), checked with the rest of the tree.

Precedence (CLI > environment > file > default) is applied in one place: `apply_overrides`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import stat
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping
from urllib.parse import unquote

from offload import redact
from offload.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4, "p": 1000**5, "pb": 1000**5,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "pib": 1 << 50,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class Size(int):
    """A byte count parsed from `512MiB`, `2TiB`, `1.5GB` or a plain integer."""

    @classmethod
    def parse(cls, value: object) -> "Size":
        if isinstance(value, bool):
            raise ValueError("a size, not a boolean")
        if isinstance(value, int):
            if value < 0:
                raise ValueError("a size cannot be negative")
            return cls(value)
        if isinstance(value, str):
            m = _SIZE_RE.match(value)
            if m and m.group(2).lower() in _UNITS:
                return cls(int(float(m.group(1)) * _UNITS[m.group(2).lower()]))
        raise ValueError("a size: bytes or a number with a unit, e.g. 512MiB, 2TiB, 1.5GB")

    def __str__(self) -> str:
        return format_size(int(self))


def format_size(n: int) -> str:
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult:
            return f"{n / mult:.2f}{unit}"
    return f"{n}B"


OnOffAuto = Literal["on", "off", "auto"]


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


# --------------------------------------------------------------------------------------------
# Generic builder: dict -> frozen dataclass, collecting every problem with its key path.


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if tp is Size:
        return "a size (e.g. 512MiB, 2TiB)"
    if origin is tuple:
        return "a list of " + {str: "strings"}.get(typing.get_args(tp)[0], "values")
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _convert(tp: Any, value: Any, path: str, problems: list[str]) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, path, problems)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed and type(value) is type(allowed[0]):
            return value
        problems.append(f"{path}: {redact.value(path, value)} is not allowed; use {_type_name(tp)}")
        return None
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, problems)
    if origin is tuple:   # tuple[X, ...]: a YAML list
        if not isinstance(value, (list, tuple)):
            problems.append(f"{path}: {redact.value(path, value)} is not a list")
            return None
        item = typing.get_args(tp)[0]
        out = [_convert(item, v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
        return tuple(out) if all(v is not None for v in out) else None
    if tp is Size:
        try:
            return Size.parse(value)
        except ValueError as e:
            problems.append(f"{path}: {redact.value(path, value)} is not {e}")
            return None
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - schema error, not user error
        raise TypeError(f"unsupported config type {tp!r} at {path}")
    problems.append(f"{path}: {redact.value(path, value)} is not {_type_name(tp)}")
    return None


# Keys that were accepted once and are refused now, with what to do instead.
REMOVED_KEYS = {
    "offload.redis.directory": "removed: it was accepted but no data path used it; delete the key "
                               "(pod-wide sharing of blocks through several agents is planned as "
                               "its own capability)",
}


def _build(cls: Any, data: Any, path: str, problems: list[str]) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        problems.append(f"{path}: expected a mapping of keys, got {type(data).__name__} "
                        f"{redact.text(repr(data))}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if f"{path}.{key}" in REMOVED_KEYS:
            problems.append(f"{path}.{key}: {REMOVED_KEYS[f'{path}.{key}']}")
            continue
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"{path}.{key}: unknown key{hint}; allowed: {', '.join(names)}")
            continue
        converted = _convert(hints[key], value, f"{path}.{key}", problems)
        if converted is not None or value is None:
            kwargs[key] = converted
    return cls(**kwargs)


def _check(cfg: OffloadConfig, problems: list[str]) -> None:
    """Append one line per range or combination problem of `cfg` to `problems`."""
    s = cfg.store
    for name in ("high_watermark", "low_watermark"):
        v = getattr(s, name)
        if not 0.0 < v <= 1.0:
            problems.append(f"offload.store.{name}: {v!r} is out of range; use 0 < x <= 1")
    if s.low_watermark >= s.high_watermark:
        problems.append(f"offload.store.low_watermark: {s.low_watermark!r} must be below "
                        f"high_watermark ({s.high_watermark!r})")
    if s.capacity < (1 << 20):
        problems.append(f"offload.store.capacity: {s.capacity!r} is too small; use at least 1MiB")
    if s.segment_size < (1 << 20):
        problems.append(f"offload.store.segment_size: {s.segment_size!r} is too small; use at "
                        "least 1MiB")
    if not 1 <= s.io_threads <= 256:
        problems.append(f"offload.store.io_threads: {s.io_threads!r} is out of range; use 1..256")
    if not s.path:
        problems.append("offload.store.path: '' is empty; name the cache directory")
    elif not s.path.startswith("/"):
        problems.append(f"offload.store.path: {s.path!r} is not an absolute path; every process "
                        "of the server (and `cache` commands) must name the same directory: "
                        "name it from the root (/...)")
    if s.salt and s.salt_file:
        problems.append("offload.store.salt_file: set together with salt; keep one (salt_file "
                        "keeps the salt out of the config file)")
    seen: dict[str, int] = {}
    for i, d in enumerate(s.paths):
        norm = d.rstrip("/") or "/"
        if not d:
            problems.append(f"offload.store.paths[{i}]: '' is empty; name a cache directory")
        elif not d.startswith("/"):
            problems.append(f"offload.store.paths[{i}]: {d!r} is not an absolute path")
        elif norm in seen:
            problems.append(f"offload.store.paths[{i}]: {d!r} is named twice (also "
                            f"paths[{seen[norm]}]); one directory per drive")
        elif any(norm.startswith(o.rstrip("/") + "/") or o.startswith(norm + "/") for o in seen):
            problems.append(f"offload.store.paths[{i}]: {d!r} lies inside another directory of "
                            "paths (or holds one); one directory per drive")
        seen.setdefault(norm, i)
    if len(s.paths) > 64:
        problems.append(f"offload.store.paths: {len(s.paths)} directories; at most 64")
    a = cfg.agent
    m = re.match(r"^\[?[A-Za-z0-9_.:-]+\]?:([0-9]{1,5})$", a.address or "")
    if a.address is not None and (not m or not 0 < int(m.group(1)) < 65536):
        problems.append(f"offload.agent.address: {a.address!r} is not HOST:PORT (port 1..65535)")
    if a.timeout_s <= 0:
        problems.append(f"offload.agent.timeout_s: {a.timeout_s!r} must be > 0")
    _check_limits(a.limits, problems)
    r = cfg.redis
    if r.url is not None and not re.match(r"^(redis|rediss|redis\+cluster|rediss\+cluster)://",
                                          r.url):
        problems.append(f"offload.redis.url: {redact.value('offload.redis.url', r.url)} is not a "
                        "redis://, rediss:// or redis+cluster:// URL")
    elif r.url is not None:
        try:
            parse_url(r.url)
        except ConfigError as e:
            problems.extend(e.problems)
    if r.timeout_s <= 0:
        problems.append(f"offload.redis.timeout_s: {r.timeout_s!r} must be > 0")
    if r.seen_n < 1:
        problems.append(f"offload.redis.seen_n: {r.seen_n!r} must be >= 1")
    if r.backoff_s < 0:
        problems.append(f"offload.redis.backoff_s: {r.backoff_s!r} must be >= 0")
    if r.ttl_s is not None and r.ttl_s <= 0:
        problems.append(f"offload.redis.ttl_s: {r.ttl_s!r} must be > 0 (or unset)")
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}(:[A-Za-z0-9_.-]{1,64}){0,3}", r.key_prefix) or any(
            re.fullmatch(r"v[0-9]+", part) for part in r.key_prefix.split(":")):
        problems.append(f"offload.redis.key_prefix: {r.key_prefix!r} is not allowed; use letters, "
                        "digits, _ . - in up to 4 parts joined by ':', none of them v<N> (the "
                        "format version follows the prefix), e.g. sglo:tenant-a")
    if (r.tls_cert_file is None) != (r.tls_key_file is None):
        problems.append("offload.redis.tls_cert_file: a client certificate needs both "
                        "tls_cert_file and tls_key_file")
    if r.url is not None and not r.url.startswith("rediss") and (
            r.tls_ca_file or r.tls_cert_file):
        problems.append("offload.redis.tls_ca_file: TLS settings need a rediss:// URL, got "
                        f"{redact.value('offload.redis.url', r.url)}")
    if cfg.transfer.path == "dpu" and cfg.agent.address is None:
        problems.append("offload.transfer.path: 'dpu' needs offload.agent.address (HOST:PORT)")
    if cfg.transfer.numa_node is not None and cfg.transfer.numa_node < 0:
        problems.append(f"offload.transfer.numa_node: {cfg.transfer.numa_node!r} is not a NUMA "
                        "node; use a node number >= 0 (`ls /sys/devices/system/node`) or unset it")
    port = cfg.metrics.port
    if port is not None and not 1 <= port <= 65535:
        problems.append(f"offload.metrics.port: {port!r} is out of range; use a TCP port 1..65535 "
                        "(with several TP ranks, port + rank must stay <= 65535) or unset it")
    w = cfg.worth_it
    if w.prefill_tokens_per_s is not None and w.prefill_tokens_per_s <= 0:
        problems.append(f"offload.worth_it.prefill_tokens_per_s: {w.prefill_tokens_per_s!r} "
                        "must be > 0")
    if not 0 < w.max_prefetch_wait_s <= 3600:
        problems.append(f"offload.worth_it.max_prefetch_wait_s: {w.max_prefetch_wait_s!r} must be "
                        "> 0 and at most 3600 (seconds a request may wait for its L3 prefetch)")


def _check_limits(lim: AgentLimitsConfig, problems: list[str]) -> None:
    at = "offload.agent.limits"
    for name in ("max_clients", "max_pending", "max_requests", "max_namespaces"):
        if getattr(lim, name) < 1:
            problems.append(f"{at}.{name}: {getattr(lim, name)!r} must be >= 1")
    if not 1 << 20 <= lim.max_frame < 1 << 32:          # the frame header's length is 32 bits
        problems.append(f"{at}.max_frame: {str(lim.max_frame)!r} is out of range; use 1MiB <= x "
                        "< 4GiB")
    if lim.staging < 1 << 20:
        problems.append(f"{at}.staging: {str(lim.staging)!r} is too small; use at least 1MiB")
    for name in ("io_timeout", "idle_timeout"):
        if not 0 < getattr(lim, name) < float("inf"):
            problems.append(f"{at}.{name}: {getattr(lim, name)!r} must be > 0 (seconds)")


def _unrelated(line: str, bad_keys: set[str]) -> bool:
    """A range/combination problem not about a key that already failed its type check (whose
    default stands in for it while checking the rest)."""
    key = line.split(":", 1)[0]
    return key not in bad_keys and not any(k.rsplit(".", 1)[-1] in line for k in bad_keys)


def load_offload(data: Any, path: str = "offload") -> OffloadConfig:
    """Validate the `offload:` tree. Raises ConfigError listing every problem (type and range
    problems of every key at once)."""
    problems: list[str] = []
    cfg = _build(OffloadConfig, data, path, problems)
    checks: list[str] = []
    _check(cfg, checks)
    bad_keys = {line.split(":", 1)[0] for line in problems}
    problems += [line for line in checks if _unrelated(line, bad_keys)]
    if problems:
        raise ConfigError(problems)
    return cfg


def _yaml_problem(e: Exception) -> str:
    """The parser's problem and where, without the quoted source line (it may hold a secret)."""
    mark = getattr(e, "problem_mark", None)
    what = getattr(e, "problem", None) or type(e).__name__
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(e, "context", None)
    return redact.text(f"{what}{where}" + (f" ({context})" if context else ""))


def _strict_loader() -> Any:
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        pass

    def mapping(loader: Any, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, str) and key in seen:
                raise ConfigError([f"line {line}: key {key!r} is given twice (also line "
                                   f"{seen[key]}); YAML would keep only the last: keep one"])
            if isinstance(key, str):
                seen[key] = line
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return StrictLoader


def _conflicts(data: Mapping[str, Any]) -> list[str]:
    """Keys of the file that contradict each other (only the file says which were given)."""
    off = data.get("offload")
    store = off.get("store") if isinstance(off, Mapping) else None
    if isinstance(store, Mapping) and store.get("paths") and "path" in store:
        return ["offload.store.path: set together with paths, which replaces it (path would be "
                "ignored); delete path, or list that directory in paths"]
    return []


def load_text(text: str, source: str = "<config>") -> DeploymentConfig:
    """Parse and validate a deployment file's text. Refused, each with its own line: YAML
    errors, a key given twice in one mapping, a file with no settings (empty or comments only),
    keys that contradict each other (`store.path` with `store.paths`), and every key problem."""
    import yaml

    try:
        data = yaml.load(text, Loader=_strict_loader())   # noqa: S506 - a SafeLoader subclass
    except ConfigError as e:
        raise ConfigError([f"{source}: {e.problems[0]}"]) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"{source}: not valid YAML: {_yaml_problem(e)}"]) from None
    if data is None:
        raise ConfigError([f"{source}: holds no settings (empty, or comments only); a deployment "
                           "file has an offload: and/or a sglang: section (configs/ has examples)"])
    if not isinstance(data, Mapping):
        raise ConfigError([f"{source}: the top level must be a mapping with offload: and/or "
                           "sglang: sections"])
    problems: list[str] = []
    for key in data:
        if key not in ("offload", "sglang"):
            close = difflib.get_close_matches(str(key), ["offload", "sglang"], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"{key}: unknown top-level section{hint}; allowed: offload, sglang")
    sglang = data.get("sglang") or {}
    if not isinstance(sglang, Mapping):
        problems.append(f"sglang: expected a mapping of SGLang server arguments, got {sglang!r}")
        sglang = {}
    problems += _conflicts(data)
    try:
        offload = load_offload(data.get("offload"))
    except ConfigError as e:
        problems.extend(e.problems)
        offload = OffloadConfig()
    if problems:
        raise ConfigError(problems)
    return DeploymentConfig(offload=offload, sglang=dict(sglang))


MAX_CONFIG_BYTES = 4 << 20


def inline_secrets(dep: DeploymentConfig) -> list[str]:
    """The keys of `dep` whose values are secrets written in the file itself (not in a file of
    their own): the tenant salt, a Redis URL with a password, SGLang's secret flags."""
    found = ["offload.store.salt"] if dep.offload.store.salt else []
    url = dep.offload.redis.url
    if url and (redact.url(url) != url):
        found.append("offload.redis.url")
    found += [f"sglang.{k}" for k, v in dep.sglang.items()
              if str(k).replace("-", "_") in redact.SGLANG_SECRET_KEYS and v not in (None, "")]
    return found


def _reread_private(path: Path, raw: bytes, dep: DeploymentConfig) -> None:
    """A file holding a secret must be the service user's own private file: read again by the
    one loader of secret files (`offload.secret.read_private_file`: owned by the effective uid,
    no group/other bits, not a symbolic link, one name, in directories only root and the
    service user can change), which must see the very bytes parsed."""
    secrets = inline_secrets(dep)
    if not secrets:
        return
    from offload.secret import read_private_file

    why = (f" (the file holds the secret {', '.join(secrets)}; or move it to a file of its own: "
           "offload.store.salt_file, offload.redis.password_file)")
    try:
        again = read_private_file(str(path), secrets[0], MAX_CONFIG_BYTES)
    except ConfigError as e:
        raise ConfigError([e.problems[0] + why]) from None
    if again != raw:
        raise ConfigError([f"{secrets[0]}: {path} changed while it was read; read it again"
                           + why])


def load_file(path: str | Path) -> DeploymentConfig:
    """`load_text` of a file (UTF-8, at most 4 MiB); a file whose settings hold a secret
    (`inline_secrets`) must be the service user's own private file, as a secret file must
    (`_reread_private`)."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as e:
        raise ConfigError([f"{p}: cannot read the config file: {e.strerror or e}"]) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):   # a FIFO would block the read for good
            raise ConfigError([f"{p}: not a regular file; name the config file itself"])
        raw = b""
        while len(raw) <= MAX_CONFIG_BYTES:
            chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - len(raw))
            if not chunk:
                break
            raw += chunk
    except OSError as e:
        raise ConfigError([f"{p}: cannot read the config file: {e.strerror or e}"]) from None
    finally:
        os.close(fd)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError([f"{p}: larger than {MAX_CONFIG_BYTES >> 20} MiB; not a config file"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([f"{p}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                           "save the config file as UTF-8"]) from None
    dep = load_text(text, str(p))
    _reread_private(p, raw, dep)
    return dep


def apply_overrides(cfg: OffloadConfig, overrides: Mapping[str, Any]) -> OffloadConfig:
    """Return cfg with dotted-key overrides (`store.path`: value) applied and re-validated."""
    tree = to_dict(cfg)
    for dotted, value in overrides.items():
        if value is None:
            continue
        node = tree
        parts = dotted.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return load_offload(tree)


def to_dict(cfg: Any) -> Any:
    """Plain data (sizes as strings like `2TiB`), suitable for YAML/JSON output and round trips."""
    if dataclasses.is_dataclass(cfg):
        out = {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
        if isinstance(cfg, StoreConfig) and cfg.paths:
            del out["path"]         # replaced by paths; a file with both is refused (_conflicts)
        return out
    if isinstance(cfg, Size):
        return str(cfg)
    if isinstance(cfg, Mapping):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, tuple):
        return [to_dict(v) for v in cfg]
    return cfg


def reference() -> list[tuple[str, str, str, str]]:
    """(key path, type, default, doc) for every setting: the README's config reference."""
    rows: list[tuple[str, str, str, str]] = []

    def walk(cls: Any, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}.{f.name}")
                continue
            default = to_dict(f.default) if f.default is not dataclasses.MISSING else ""
            rows.append((f"{prefix}.{f.name}", _type_name(tp), repr(default),
                         f.metadata.get("doc", "")))

    walk(OffloadConfig, "offload")
    return rows


# The Redis URL grammar (read by the Redis tier's link, `offload.store.redis.link`, and by detect).

_SCHEMES = {"redis": (False, False), "rediss": (True, False),
            "redis+cluster": (False, True), "rediss+cluster": (True, True)}


@dataclass(frozen=True)
class RedisTarget:
    tls: bool
    cluster: bool
    nodes: list[tuple[str, int]] = field(default_factory=list)
    db: int = 0
    username: str | None = None
    password: str | None = None

    def display(self) -> str:
        """The URL without credentials (for messages and logs)."""
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        hosts = ",".join(f"{h}:{p}" for h, p in self.nodes)
        return f"{scheme}://{hosts}" + (f"/{self.db}" if self.db else "")


def _part(part: str, url: str, what: str) -> str:
    """A piece of the URL to quote, or `what` it is when the URL has userinfo (a password
    holding `/` or `,` would put part of it in the piece)."""
    return repr(part) if "@" not in url else what


def parse_url(url: str) -> RedisTarget:
    """`redis[s][+cluster]://[[user]:password@]host[:port][,host:port...][/db]`.

    Raises ConfigError; its lines show the URL with the password masked (`redact.url`)."""
    shown = redact.value("offload.redis.url", url)
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise ConfigError([f"offload.redis.url: {shown} is not a redis://, rediss://, "
                           "redis+cluster:// or rediss+cluster:// URL"])
    tls, cluster = _SCHEMES[scheme]
    if "?" in rest or "#" in rest:
        raise ConfigError([f"offload.redis.url: query options are not read; set TLS and "
                           f"password in offload.redis instead (got {shown})"])
    netloc, _, path = rest.partition("/")
    username = password = None
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    nodes: list[tuple[str, int]] = []
    for hp in netloc.split(","):
        host, port = hp, "6379"
        if hp.startswith("["):                       # [ipv6]:port
            host, bracket, tail = hp[1:].partition("]")
            port = tail[1:] if tail.startswith(":") else "6379" if bracket and not tail else ""
            ok_host = bool(re.fullmatch(r"[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?", host))
        else:
            if ":" in hp:
                host, _, port = hp.rpartition(":")
            ok_host = bool(re.fullmatch(r"[A-Za-z0-9_.-]+", host))   # a name or IPv4; IPv6 in []
        if not ok_host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError([f"offload.redis.url: {_part(hp, url, 'a host')} in {shown} is not "
                               "HOST[:PORT] (port 1..65535)"])
        nodes.append((host, int(port)))
    if len(nodes) > 1 and not cluster:
        raise ConfigError([f"offload.redis.url: several hosts need redis+cluster:// ({shown})"])
    db = 0
    if path:
        if not path.isdigit() or (cluster and int(path) != 0):
            raise ConfigError([f"offload.redis.url: database {_part(path, url, 'path')} is not a number"
                               + (" (a cluster has only database 0)" if cluster else "")])
        db = int(path)
    return RedisTarget(tls, cluster, nodes, db, username, password)
