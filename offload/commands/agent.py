"""`sglang-offload agent`: run the storage agent (on a BlueField's Arm cores, or any storage host).

    sglang-offload agent --listen 0.0.0.0:7400 --store /var/cache/sglang-offload \\
        --capacity 2TiB --keys-file /etc/sglang-offload/agent-keys.toml [--transport ucx|tcp]

Credentials: a keys file (`--keys-file`: per-host secrets and the namespaces / tenant salts each
host may use), or one shared secret (`--secret-file` / $SGLANG_OFFLOAD_SECRET: every holder is one
trusted host group).

The agent owns one block store (the persistent disk store; `--memory` for a DRAM-only store used
by tests and benchmarks) and serves many inference hosts. It prints `listening on HOST:PORT` once
ready (and writes the port to `--ready-file`), logs every rejected connection with its reason, and
stops cleanly on SIGTERM/SIGINT (the store is closed, so its index is consistent on restart).

Limits: each `--max-*` / `--staging` / `--*-timeout` flag is also the key of the same name (`_` for
`-`) of `offload.agent.limits` in a `--config FILE`; `limits_config(args)` applies the precedence
(flag given > file > default) and `AgentLimits.from_config` makes the server's one value of it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
from typing import Mapping

from offload.config import AgentLimitsConfig, OffloadConfig, Size, StoreConfig, apply_overrides, load_file
from offload.errors import ConfigError, OffloadError, RunError, StoreError
from offload.store.base import BlockStore


def _size(text: str) -> int:
    try:
        return int(Size.parse(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not {e}") from None


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535 or not host:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


# The limit flags: each sets offload.agent.limits.<flag without -- and with _>, whose default it
# shows ({d}); unset (None) here, so the file's value or the default stands (`limits_config`).
LIMIT_FLAGS = [
    ("--max-clients", "N", "authenticated connections at once, per host key of --keys-file (in "
                           "all with a shared secret; default {d})"),
    ("--max-requests", "N", "requests in progress at once, per host key (in all with a shared "
                            "secret; default {d})"),
    ("--max-namespaces", "N", "namespaces registered at once, per host key (in all with a shared "
                              "secret); a host's expire when its last connection closes "
                              "(default {d})"),
    ("--max-pending", "N", "connections still authenticating at once (more are closed at accept; "
                           "default {d})"),
    ("--max-frame", "SIZE", "largest request or reply frame (default {d}; 64KiB before a "
                            "verified HELLO)"),
    ("--staging", "SIZE", "staging memory per NIXL connection, two halves (default {d}; the "
                          "largest block is half of it)"),
    ("--max-quarantine", "SIZE", "memory that transfers past their deadline may hold, per host "
                                 "key (in all with a shared secret); its NIXL requests are "
                                 "refused past it (default {d})"),
    ("--max-memory", "SIZE", "memory held for all connections together: request frames, "
                             "replies, staging, announced pages (default {d})"),
    ("--max-memory-per-key", "SIZE", "memory held for one host key's connections: request "
                                     "frames, replies, staging, announced pages (default {d})"),
    ("--io-timeout", "S", "seconds a started frame (and the whole handshake) may take to arrive "
                          "(default {d})"),
    ("--idle-timeout", "S", "seconds an authenticated connection may wait with no request "
                            "before it is closed (default {d})"),
]


def _shown(default: object) -> str:
    return f"{default:g}" if isinstance(default, float) else str(default)


def limits_config(args: argparse.Namespace) -> AgentLimitsConfig:
    """The limits, in one place: each flag given > the file's offload.agent.limits > default.
    A bad value is a ConfigError naming the flag, or the file's key path."""
    base = load_file(args.config).offload if args.config else OffloadConfig()
    given = {f[2:].replace("-", "_"): f for f, _, _ in LIMIT_FLAGS
             if getattr(args, f[2:].replace("-", "_")) is not None}
    try:
        cfg = apply_overrides(base, {f"agent.limits.{k}": getattr(args, k) for k in given})
    except ConfigError as e:
        raise ConfigError([_flag_named(line, given) for line in e.problems]) from None
    return cfg.agent.limits


def _flag_named(line: str, given: dict[str, str]) -> str:
    """`offload.agent.limits.KEY: ...` -> `--FLAG: ...` when the value came from that flag."""
    key, sep, rest = line.removeprefix("offload.agent.limits.").partition(":")
    return f"{given[key]}:{rest}" if sep and line.startswith("offload.agent.limits.") and \
        key in given else line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.splitlines()[0]
    p.add_argument("--listen", type=_listen, required=True, metavar="HOST:PORT",
                   help="address to serve hosts on (port 0: any free port)")
    p.add_argument("--store", metavar="DIR", action="append",
                   help="cache directory of the agent's block store; repeat it for several "
                        "drives (one store: blocks spread by key, one cap)")
    p.add_argument("--capacity", type=_size, default=Size(100 << 30), metavar="SIZE",
                   help="cap of the store (default 100GiB)")
    p.add_argument("--memory", action="store_true",
                   help="keep blocks in DRAM only (tests, benchmarks); lost on restart")
    p.add_argument("--memory-reserve", type=_size, default=Size(256 << 20), metavar="SIZE",
                   help="with --memory: DRAM faulted in ahead of the fill point (default 256MiB); "
                        "set it to --capacity to preallocate the whole tier before serving")
    p.add_argument("--transport", choices=["ucx", "tcp"], default="ucx",
                   help="ucx: NIXL moves the bytes (RDMA, or UCX over TCP); tcp: no NIXL, bytes "
                        "travel on the control connection (default ucx)")
    p.add_argument("--secret-file", metavar="FILE",
                   help="shared secret (mode 600); default: $SGLANG_OFFLOAD_SECRET")
    p.add_argument("--keys-file", metavar="FILE",
                   help="per-host credentials (TOML, mode 600; see docs/deploy/agent.md); "
                        "replaces the shared secret")
    p.add_argument("--config", metavar="FILE",
                   help="deployment YAML whose offload.agent.limits section sets the limits below "
                        "(validated whole; each flag given wins over its key)")
    for flag, metavar, text in LIMIT_FLAGS:
        key = flag[2:].replace("-", "_")
        p.add_argument(flag, type=_size if metavar == "SIZE" else int if metavar == "N" else float,
                       default=None, metavar=metavar,
                       help=text.format(d=_shown(getattr(AgentLimitsConfig, key))))
    p.add_argument("--ready-file", metavar="FILE", help="write the listening port here when ready")


def open_store(args: argparse.Namespace) -> BlockStore:
    if args.memory and args.store:
        raise ConfigError([f"agent: --memory keeps blocks in DRAM and uses no directory, but "
                           f"--store {' --store '.join(args.store)} was given too; drop --store "
                           "(DRAM only, lost on restart) or --memory (the disk store there)"])
    if args.memory:
        from offload.store.factory import open_memory

        # Memory kept faulted in ahead of the fill point: a burst of puts copies without faults.
        store = open_memory(args.capacity, reserve=args.memory_reserve)
        if not store.wait_reserve(timeout=600.0):
            logging.getLogger("offload.agent").warning(
                "the DRAM reserve is not fully faulted in yet; serving anyway")
        return store
    if not args.store:
        raise ConfigError(["agent: name the cache directory with --store DIR (or use --memory)"])
    try:
        from offload.store.factory import open_disk
    except ImportError as e:
        raise StoreError(f"the disk store is not available: {e}") from None
    dirs = list(args.store)
    if len({os.path.realpath(d) for d in dirs}) < len(dirs):
        raise ConfigError([f"agent: --store names one directory twice ({', '.join(dirs)}); one "
                           "directory per drive"])
    return open_disk(StoreConfig(path=dirs[0], paths=tuple(dirs) if len(dirs) > 1 else (),
                                 capacity=Size(args.capacity)))


def run(args: argparse.Namespace) -> int:
    from offload.agent.access import Access
    from offload.agent.auth import load_keys, load_secret
    from offload.agent.limits import AgentLimits
    from offload.agent.server import AgentServer

    agent_log = logging.getLogger("offload.agent")
    if agent_log.getEffectiveLevel() > logging.INFO:
        agent_log.setLevel(logging.INFO)       # connections and rejections are always logged
    limits = AgentLimits.from_config(limits_config(args))
    if args.keys_file and args.secret_file:
        raise ConfigError(["agent: --keys-file replaces --secret-file; name one of them"])
    access = (Access.per_host(load_keys(args.keys_file)) if args.keys_file
              else Access.shared(load_secret(args.secret_file)))
    store = open_store(args)
    host, port = args.listen
    server = AgentServer(store, access, host, port, transport=args.transport, limits=limits)
    try:
        server.start()
    except OSError as e:
        store.close()
        raise OffloadError(f"agent: cannot listen on {host}:{port}: {e.strerror or e}") from None
    except Exception as e:
        store.close()
        if is_nixl_backend_error(e):
            raise RunError(ucx_advice(os.environ)) from None
        raise

    def _stop(signum: int, _frame: object) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(f"listening on {host}:{server.port}", flush=True)
    if args.ready_file:
        write_ready(args.ready_file, server.port)
    try:
        server.serve_forever()
    finally:
        server.stop()
        server.join(timeout=2.0)
        store.close()
        print("agent stopped", file=sys.stderr, flush=True)
    return 0


def is_nixl_backend_error(e: BaseException) -> bool:
    """NIXL's error when it cannot create its UCX backend (nixlBackendError: NIXL_ERR_BACKEND)."""
    return type(e).__name__ == "nixlBackendError" or "NIXL_ERR_BACKEND" in str(e)


def ucx_advice(env: Mapping[str, str]) -> str:
    """What to do when UCX cannot start on this host: the settings that decide it, as set now."""
    now = ", ".join(f"{k}={env[k]!r}" for k in ("UCX_TLS", "UCX_NET_DEVICES") if k in env)
    return ("agent: --transport ucx: NIXL could not create its UCX backend (NIXL_ERR_BACKEND; "
            "UCX's own lines above say why, e.g. 'no usable transports/devices'); check UCX_TLS "
            f"and UCX_NET_DEVICES ({now or 'both unset'}): unset them or name transports and "
            "devices this host has (`ucx_info -d` lists them), or run the agent and the hosts "
            "with --transport tcp (offload.agent.transport: tcp)")


def write_ready(path: str, port: int) -> None:
    """Write the port to `path` atomically: a private temp file made by mkstemp (O_EXCL, a random
    name, so no symlink planted at a predictable name is followed) in the same directory, renamed
    over `path` (rename replaces a symlink at `path` itself, never its target)."""
    fd, tmp = tempfile.mkstemp(prefix=".ready-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(str(port))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
