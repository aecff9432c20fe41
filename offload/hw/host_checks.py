"""What would fail at start on this machine, checked before it starts (`config validate`,
`detect`, `launch`).

Primitives:
- `numa_nodes(root) -> tuple[int, ...] | None`: the nodes under `/sys/devices/system/node`
  (None when the directory is missing: not checked).
- `check_host(cfg, root, cache_dir, connect) -> HostFindings`: every problem at once, each a line
  naming the key (or `--cache-dir`), the bad value and the fix:
  errors: `transfer.numa_node` that is not a node of the machine; a cache directory (each of
  `store.paths`, or `path`, or `--cache-dir`) naming something that is not a directory, or on a
  pseudo file system (proc, sysfs, ...); and, on the
  live machine only (a fixture root's files are not this machine's), a secret file
  (`redis.password_file`, `redis.secret_file`, `agent.secret_file`, `redis.tls_key_file`)
  the one loader refuses (`offload.secret`: missing, a link, another user's, not
  private, too long or too short), and TLS files that cannot be read.
  Warnings (only when `connect` is given, i.e. `detect` on the live machine): a Redis node of
  `redis.url` that does not accept a TCP connection, named by HOST:PORT (never the password).
Reads go through `Root`; secret contents are read (to check them) and never returned.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from offload.config import OffloadConfig
from offload.errors import ConfigError
from offload.hw.fsroot import Root
from offload.hw.numa import numa_nodes as node_dirs
from offload.hw.storage import probe_cache_dir

NODE_DIR = "/sys/devices/system/node"
# File systems that cannot hold the cache (no regular files of ours, no O_DIRECT).
PSEUDO_FS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
    "securityfs", "pstore", "bpf", "configfs", "fusectl", "mqueue", "autofs", "binfmt_misc",
    "nsfs", "efivarfs", "selinuxfs", "rpc_pipefs", "hugetlbfs"})

Connect = Callable[[str, float], "tuple[bool, str]"]


@dataclass(frozen=True)
class HostFindings:
    errors: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def numa_nodes(root: Root) -> tuple[int, ...] | None:
    """The machine's NUMA nodes (the ones CPU staging pins to), None when not known."""
    return tuple(node_dirs(root.path)) if root.isdir(NODE_DIR) else None


def _numa(cfg: OffloadConfig, root: Root) -> list[str]:
    want = cfg.transfer.numa_node
    nodes = numa_nodes(root)
    if want is None or nodes is None or want in nodes:
        return []
    have = ", ".join(map(str, nodes)) or "none"
    return [f"offload.transfer.numa_node: {want} is not a NUMA node of this machine (nodes: {have} "
            f"in {NODE_DIR}); use one of them or unset it (then the GPU's node is used)"]


def _cache_dir(root: Root, path: str, key: str) -> list[str]:
    machine = os.path.normpath(path if path.startswith("/") else os.path.abspath(path))
    if root.exists(machine) and not root.isdir(machine):
        return [f"{key} exists and is not a directory; name a directory (it is created if missing)"]
    fs = probe_cache_dir(root, machine).fs_type
    if fs in PSEUDO_FS:
        return [f"{key} is on a {fs} file system, which cannot hold the cache (no files of ours, "
                "no O_DIRECT); use a directory on a local ext4 or xfs file system"]
    return []


def _secret_files(cfg: OffloadConfig) -> list[str]:
    from offload.secret import MAX_SECRET_BYTES, MIN_SECRET_BYTES, read_private_file, read_secret_file

    out: list[str] = []
    for setting, path, min_bytes in (
            ("offload.redis.password_file", cfg.redis.password_file, 1),
            ("offload.redis.secret_file", cfg.redis.secret_file, MIN_SECRET_BYTES),
            ("offload.agent.secret_file", cfg.agent.secret_file, MIN_SECRET_BYTES)):
        if not path:
            continue
        try:
            read_secret_file(path, setting, min_bytes=min_bytes)
        except ConfigError as e:
            out += e.problems
    if cfg.redis.tls_key_file:          # a key file: the loader's checks (owner, mode, size)
        try:
            read_private_file(cfg.redis.tls_key_file, "offload.redis.tls_key_file",
                              MAX_SECRET_BYTES)
        except ConfigError as e:
            out += e.problems
    for setting, path in (("offload.redis.tls_ca_file", cfg.redis.tls_ca_file),
                          ("offload.redis.tls_cert_file", cfg.redis.tls_cert_file)):
        if path and not os.access(path, os.R_OK):
            out.append(f"{setting}: cannot read {path}; fix the path or its permissions")
    return out


def _redis_reachable(cfg: OffloadConfig, connect: Connect) -> list[str]:
    from offload.config import parse_url

    if not cfg.redis.url:
        return []
    out = []
    for host, port in parse_url(cfg.redis.url).nodes:
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        ok, why = connect(address, min(cfg.redis.timeout_s * 4, 2.0))
        if not ok:
            reason = why.split(": ", 1)[-1]
            out.append(f"offload.redis.url: Redis at {address} is not reachable ({reason}); "
                       "the tier serves misses until it is (start Redis or fix the address)")
    return out


def check_host(cfg: OffloadConfig, root: str | Root = "/", cache_dir: str | None = None,
               connect: Connect | None = None) -> HostFindings:
    """Every start-time problem of `cfg` on the machine under `root` (see the module doc)."""
    r = root if isinstance(root, Root) else Root(root)
    if cache_dir is not None:
        dirs = [(cache_dir, f"--cache-dir {cache_dir}")]
    elif cfg.store.paths:
        dirs = [(d, f"offload.store.paths[{i}]: {d}") for i, d in enumerate(cfg.store.paths)]
    else:
        dirs = [(cfg.store.path, f"offload.store.path: {cfg.store.path}")]
    errors = _numa(cfg, r) + [e for path, key in dirs for e in _cache_dir(r, path, key)]
    if r.live:
        errors += _secret_files(cfg)
    warnings = _redis_reachable(cfg, connect) if connect is not None and r.live else []
    return HostFindings(tuple(errors), tuple(warnings))
