"""Ranges and combinations: the checks run on a built tree, one function per section, each
appending one line per problem (the key path, the bad value, what is allowed) to `problems`.

Primitives:
- `check(cfg, problems)`: every section's check, in the order of the reference.
- `unrelated(line, bad_keys)`: whether a check's line is about a key that did not already fail its
  type check (its default stood in for it while the rest was checked), so it is not reported twice.
"""

from __future__ import annotations

import re

from offload import redact
from offload.config.redis_url import parse_url
from offload.config.tree import (
    AgentConfig,
    AgentLimitsConfig,
    MetricsConfig,
    OffloadConfig,
    RedisConfig,
    StoreConfig,
    TransferConfig,
    WorthItConfig,
)
from offload.errors import ConfigError


def check(cfg: OffloadConfig, problems: list[str]) -> None:
    """Append one line per range or combination problem of `cfg` to `problems`."""
    check_store(cfg.store, problems)
    check_agent(cfg.agent, problems)
    check_redis(cfg.redis, problems)
    check_transfer(cfg.transfer, cfg.agent, problems)
    check_metrics(cfg.metrics, problems)
    check_worth_it(cfg.worth_it, problems)


def check_store(s: StoreConfig, problems: list[str]) -> None:
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
    _check_paths(s.paths, problems)


def _check_paths(paths: tuple[str, ...], problems: list[str]) -> None:
    seen: dict[str, int] = {}
    for i, d in enumerate(paths):
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
    if len(paths) > 64:
        problems.append(f"offload.store.paths: {len(paths)} directories; at most 64")


def check_agent(a: AgentConfig, problems: list[str]) -> None:
    m = re.match(r"^\[?[A-Za-z0-9_.:-]+\]?:([0-9]{1,5})$", a.address or "")
    if a.address is not None and (not m or not 0 < int(m.group(1)) < 65536):
        problems.append(f"offload.agent.address: {a.address!r} is not HOST:PORT (port 1..65535)")
    if a.timeout_s <= 0:
        problems.append(f"offload.agent.timeout_s: {a.timeout_s!r} must be > 0")
    check_limits(a.limits, problems)


def check_limits(lim: AgentLimitsConfig, problems: list[str]) -> None:
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


def check_redis(r: RedisConfig, problems: list[str]) -> None:
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


def check_transfer(t: TransferConfig, agent: AgentConfig, problems: list[str]) -> None:
    if t.path == "dpu" and agent.address is None:
        problems.append("offload.transfer.path: 'dpu' needs offload.agent.address (HOST:PORT)")
    if t.numa_node is not None and t.numa_node < 0:
        problems.append(f"offload.transfer.numa_node: {t.numa_node!r} is not a NUMA "
                        "node; use a node number >= 0 (`ls /sys/devices/system/node`) or unset it")
    if t.write_budget is not None and t.write_budget < 1 << 20:
        problems.append(f"offload.transfer.write_budget: {t.write_budget!r} bytes per second is "
                        "less than one page a second; use at least 1MiB or unset it")


def check_metrics(m: MetricsConfig, problems: list[str]) -> None:
    port = m.port
    if port is not None and not 1 <= port <= 65535:
        problems.append(f"offload.metrics.port: {port!r} is out of range; use a TCP port 1..65535 "
                        "(with several TP ranks, port + rank must stay <= 65535) or unset it")


def check_worth_it(w: WorthItConfig, problems: list[str]) -> None:
    if w.prefill_tokens_per_s is not None and w.prefill_tokens_per_s <= 0:
        problems.append(f"offload.worth_it.prefill_tokens_per_s: {w.prefill_tokens_per_s!r} "
                        "must be > 0")
    if not 0 < w.max_prefetch_wait_s <= 3600:
        problems.append(f"offload.worth_it.max_prefetch_wait_s: {w.max_prefetch_wait_s!r} must be "
                        "> 0 and at most 3600 (seconds a request may wait for its L3 prefetch)")


def unrelated(line: str, bad_keys: set[str]) -> bool:
    """A range/combination problem not about a key that already failed its type check (whose
    default stands in for it while checking the rest)."""
    key = line.split(":", 1)[0]
    return key not in bad_keys and not any(k.rsplit(".", 1)[-1] in line for k in bad_keys)
