"""The grammar of `offload.redis.url`: standalone or cluster, TLS or not, nodes, database,
credentials. Read by the config checks (a bad URL is a config error), by the Redis tier's link
(`offload.store.redis.link`) and by detect; it stands here, below every tier, so that the config
never imports the store.

Primitives:
- `parse_url(url)` -> `RedisTarget`: `redis[s][+cluster]://[[user]:password@]host[:port][,...][/db]`;
  raises `ConfigError` whose lines show the URL with its password masked.
- `RedisTarget`: the parts of a URL; `display()` is the URL without credentials.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import unquote

from offload import redact
from offload.errors import ConfigError

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
