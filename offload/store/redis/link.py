"""The connection to Redis behind the Redis tier: URL parsing, AUTH/TLS, cluster, circuit breaker.

Primitives:
- The URL grammar (`parse_url(url)` -> `RedisTarget`) is `offload.config`'s: a bad URL is a config error.
- `Vectored(parts)`: one bulk-string argument sent as several buffers, so a block header and
  the caller's (possibly many) page buffers go on the socket without being joined first.
- `RedisLink(cfg)`: owns one redis-py client (built lazily, rebuilt after a failure) and a circuit
  breaker. `link.run(fn)` calls `fn(client)`; on a connection error or timeout it counts the
  failure, drops the client and refuses calls for `backoff_s` (they return None at once), then
  lets the next call reconnect. redis-py's own retries are off, so a dead or hung Redis costs
  one timeout, then nothing. Every call is bounded as a whole (`call`): `link.call(nbytes,
  commands)` bounds the calls made inside it (a deadline of `timeout_s` + nbytes / 128 MiB/s, a
  reply allowance); a `run` outside one is bounded by itself (`timeout_s`, 64 MiB of reply).
  A `ProtocolError` from `fn` (a reply stream out of step) is a failure like any other: the
  connection is dropped, so the next call starts in step. Its secret files (`password_file`,
  `tls_key_file`) are read at construction by the one loader (`offload.secret`); OpenSSL
  is handed the checked copy of the TLS key, never the configured path.

redis-py is imported inside the functions that need it, never at import of `offload`.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import AbstractContextManager
from typing import Any, Callable, Sequence, TypeVar, cast

from offload import redact
from offload.config import RedisConfig, parse_url
from offload.errors import ConfigError, StoreError
from offload.secret import PrivateCopy, read_secret_file
from offload.store.base import Buffer
from offload.store.redis.call import (
    CONTROL_RECV_BYTES,
    REPLY_BYTES_PER_COMMAND,
    BoundedSocket,
    CallBounds,
    ProtocolError,
    ReplyTooLong,
    call_seconds,
)

log = logging.getLogger("offload.store.redis.store")
T = TypeVar("T")

class Vectored:
    """One bulk-string argument sent as several buffers (no join, no copy on the client)."""

    __slots__ = ("parts", "nbytes")

    def __init__(self, parts: Sequence[Buffer]):
        self.parts = [memoryview(p).cast("B") for p in parts]
        self.nbytes = sum(p.nbytes for p in self.parts)


def _connection_class(tls: bool, bounds: CallBounds) -> type:
    """A redis-py connection class whose packer writes `Vectored` arguments buffer by buffer and
    whose socket enforces `bounds` (`call.BoundedSocket`)."""
    from redis.connection import Connection, SSLConnection

    base: type = SSLConnection if tls else Connection

    class VectoredConnection(base):  # type: ignore[misc, valid-type]
        def _connect(self) -> Any:
            return BoundedSocket(super()._connect(), bounds)

        def pack_command(self, *args: Any) -> list[Any]:
            if not any(isinstance(a, Vectored) for a in args):
                return super().pack_command(*args)
            out: list[Any] = [b"*%d\r\n" % len(args)]
            for a in args:
                if isinstance(a, Vectored):
                    out.append(b"$%d\r\n" % a.nbytes)
                    out.extend(a.parts)
                    out.append(b"\r\n")
                else:
                    enc = self.encoder.encode(a)
                    out.append(b"$%d\r\n" % len(enc))
                    out.append(bytes(enc) + b"\r\n")
            return out

        def pack_commands(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
            out: list[Any] = []
            small: list[bytes] = []
            for cmd in commands:
                for chunk in self.pack_command(*cmd):
                    if isinstance(chunk, memoryview) or len(chunk) > 6000:
                        if small:
                            out.append(b"".join(small))
                            small = []
                        out.append(chunk)
                    else:
                        small.append(chunk)
            if small:
                out.append(b"".join(small))
            return out

    return VectoredConnection


def read_password_file(path: str) -> str:
    """The Redis AUTH password: a file private to its owner (`secret.read_secret_file`)."""
    raw = read_secret_file(path, "offload.redis.password_file", min_bytes=1)
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise ConfigError([f"offload.redis.password_file: {path} is not UTF-8 text"]) from None


def _DOWN_ERRORS() -> tuple[type, ...]:
    from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError

    return (BusyLoadingError, ConnectionError, TimeoutError)


class RedisLink:
    def __init__(self, cfg: RedisConfig, *, clock: Callable[[], float] = time.monotonic):
        if not cfg.url:
            raise ConfigError(["offload.redis.url: unset; the Redis tier needs a URL"])
        self.cfg = cfg
        self.target = parse_url(cfg.url)
        self._password = (read_password_file(cfg.password_file) if cfg.password_file
                          else self.target.password)
        self._tls_key = (PrivateCopy(cfg.tls_key_file, "offload.redis.tls_key_file")
                         if cfg.tls_key_file else None)
        self._clock = clock
        self._lock = threading.Lock()
        self.bounds = CallBounds()
        self._client: Any = None
        self._down_until = 0.0
        self._was_down = False
        self.failures = 0
        self.timeouts = 0
        self.skipped_while_down = 0
        self.reconnects = 0
        self.protocol_errors = 0
        self.last_error = ""

    # -- client construction ---------------------------------------------------------------
    def _kwargs(self) -> dict[str, Any]:
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        kw: dict[str, Any] = dict(
            username=self.target.username, password=self._password,
            socket_timeout=self.cfg.timeout_s, socket_connect_timeout=self.cfg.timeout_s,
            retry=Retry(NoBackoff(), 0), connection_class=_connection_class(self.target.tls, self.bounds))
        if self.target.tls:
            kw.update(ssl_ca_certs=self.cfg.tls_ca_file, ssl_certfile=self.cfg.tls_cert_file,
                      ssl_keyfile=self._tls_key.path if self._tls_key else None,
                      ssl_cert_reqs="required",
                      ssl_check_hostname=True)
        return kw

    def _build(self) -> Any:
        import redis

        kw = self._kwargs()
        if self.target.cluster:
            from redis.cluster import ClusterNode, RedisCluster

            host, port = self.target.nodes[0]
            # A plain URL so that redis-py keeps our connection class (rediss:// would replace it).
            return RedisCluster(
                url=f"redis://{host}:{port}",
                startup_nodes=[ClusterNode(h, p) for h, p in self.target.nodes],
                require_full_coverage=False, **kw)
        host, port = self.target.nodes[0]
        pool = redis.ConnectionPool(host=host, port=port, db=self.target.db, **kw)
        return redis.Redis(connection_pool=pool)

    # -- the breaker -----------------------------------------------------------------------
    def available(self) -> bool:
        return self._clock() >= self._down_until

    def call(self, nbytes: int = 0, commands: int = 1) -> AbstractContextManager[None]:
        """Bound every `run` inside this block as one call: it ends within `timeout_s` + nbytes /
        128 MiB/s and receives at most nbytes + 256 bytes a command + 1 MiB (`call`).

        Args:
            nbytes: the bytes the call moves (values sent plus values expected back).
            commands: how many commands it sends (each gets room for its reply's framing).
        """
        return self.bounds.call(call_seconds(self.cfg.timeout_s, nbytes),
                                nbytes + commands * REPLY_BYTES_PER_COMMAND)

    def run(self, fn: Callable[[Any], T], what: str = "call") -> T | None:
        """fn(client), or None when Redis is down or failed now (counted, logged, backed off).

        Bounded by the enclosing `call`, or by itself (`timeout_s`, 64 MiB of reply)."""
        if self._clock() < self._down_until:
            self.skipped_while_down += 1
            return None
        with self.bounds.call(call_seconds(self.cfg.timeout_s), CONTROL_RECV_BYTES):
            return self._run(fn, what)

    def _run(self, fn: Callable[[Any], T], what: str) -> T | None:
        import redis

        try:
            with self._lock:
                if self._client is None:
                    self._client = self._build()
                client = self._client
            result = fn(client)
            if isinstance(result, list):  # pipelines return per-command errors; some mean "down"
                for r in result:
                    if isinstance(r, _DOWN_ERRORS()):
                        raise cast(BaseException, r)
        except (redis.exceptions.RedisError, OSError) as e:
            self._fail(what, e)
            return None
        if self._was_down:
            self._was_down = False
            self.reconnects += 1
            log.info("Redis tier %s is back", self.target.display())
        return result

    def _fail(self, what: str, e: BaseException) -> None:
        import redis

        self.failures += 1
        if isinstance(e, (redis.exceptions.TimeoutError, TimeoutError)):
            self.timeouts += 1
        if isinstance(e, ProtocolError) or isinstance(e.__context__, ReplyTooLong):
            self.protocol_errors += 1
        kind = ("authentication failed" if isinstance(e, redis.exceptions.AuthenticationError)
                else type(e).__name__)
        self.last_error = redact.text(f"{kind}: {e}", [self._password or ""])   # logged, exported
        self._down_until = self._clock() + self.cfg.backoff_s
        if not self._was_down:
            log.warning("Redis tier %s failed during %s (%s); serving without it for %.1fs",
                        self.target.display(), what, self.last_error, self.cfg.backoff_s)
        self._was_down = True
        self._drop()

    def _drop(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a broken client must not raise into the data path
                pass

    def ping(self) -> None:
        """Control path: raise StoreError naming the server and the reason if Redis is unusable."""
        self._down_until = 0.0
        if self.run(lambda c: c.ping(), "ping") is None:
            raise StoreError(f"Redis tier {self.target.display()} is not usable: "
                             f"{self.last_error}")

    def counters(self) -> dict[str, object]:
        return {"failures": self.failures, "timeouts": self.timeouts,
                "skipped_while_down": self.skipped_while_down, "reconnects": self.reconnects,
                "protocol_errors": self.protocol_errors,
                "down": not self.available(), "last_error": self.last_error,
                "url": self.target.display()}

    def close(self) -> None:
        self._drop()
