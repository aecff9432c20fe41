"""The storage agent: owns one block store and serves many inference hosts over TCP.

Primitives: `AgentServer(store, access, host, port, transport=, limits=, name=)` (`access`: an
`offload.agent.access.Access`, or a shared secret's bytes; `limits`: one
`offload.agent.limits.AgentLimits`); `.start()` binds and listens (port 0 picks a free one,
`.port` tells which), `.serve_forever()` accepts until `.stop()`, each connection served by its
own thread (`offload.agent.session.Session`). With `transport="ucx"` one NIXL agent
(`offload.agent.mover.Mover`) moves the bytes of every host that registered its memory; with
"tcp" NIXL is never imported and bytes travel on the connections.
Limits: `max_pending` connections not yet authenticated (more are closed at accept), then
`max_clients` authenticated ones, `max_requests` requests in progress and `max_namespaces`
registered namespaces *per tenant* (a host key
of the keys file; every holder of a shared secret is one tenant: `Access.connect` / `.begin`),
so that one tenant cannot lock out another; `max_body` bytes per frame (`protocol.
PRE_AUTH_MAX_BODY` before a verified HELLO), `max_block` bytes per block, `staging_size` bytes of
staging per NIXL connection, `max_quarantine` bytes per tenant held by its transfers that
outlived their budget (`offload.agent.quarantine`: its NIXL requests are refused past it, and
at most what is left of it goes straight into store slots). An `accept` error (EMFILE: out of
descriptors) is logged and retried after `ACCEPT_BACKOFF_S`; the agent keeps serving the
connections it has.
A `SlotStore` with an arena (the DRAM tier, `MemoryStore(reserve>0)`) gets it registered with
NIXL (`.direct()`), and its blocks move with no staging copy. A store that commits in the
background (the disk store) has its acknowledged, not yet durable puts hidden by `.acks`
(`offload.agent.acks`), stopped by `.stop()`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from offload.agent.access import Access
from offload.agent.acks import Acks
from offload.agent.budget import Memory
from offload.agent.context import AgentContext
from offload.agent.describe import Describer
from offload.agent.feed import Feeds
from offload.agent.limits import AgentLimits
from offload.agent.rate import Challenges
from offload.agent.session import Session
from offload.store.base import BlockStore, SlotStore

if TYPE_CHECKING:
    from offload.agent.direct import Direct
    from offload.agent.mover import Arena, Mover

log = logging.getLogger("offload.agent")
ACCEPT_BACKOFF_S = 0.2
LOG_EVERY_S = 5.0          # repeated rejections of one kind are logged at most this often


class AgentServer:
    def __init__(self, store: BlockStore, access: Access | bytes, host: str = "0.0.0.0",
                 port: int = 0, *, transport: str = "ucx", limits: AgentLimits | None = None,
                 name: str | None = None):
        lim = self.limits = limits or AgentLimits()
        self.store = store
        self.access = access if isinstance(access, Access) else Access.shared(access)
        self.access.max_conns = lim.max_clients
        self.access.max_requests = lim.max_requests
        self.access.max_namespaces = lim.max_namespaces
        self.host = host
        self.port = port
        self.transport = transport
        self.max_pending = lim.max_pending
        self.max_quarantine = int(lim.max_quarantine)
        self.max_body = int(lim.max_body)
        self.staging_size = int(lim.staging_size)
        self.max_block = lim.max_block
        self.io_timeout = lim.io_timeout
        self.idle_timeout = lim.idle_timeout
        self.name = name or f"sglang-offload-agent-{socket.gethostname()}-{os.getpid()}"
        self.stopping = False
        self.mover: "Mover | None" = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()
        self._sessions: dict[int, threading.Thread] = {}
        self._pending = 0            # accepted, not yet admitted (authenticated ones: access)
        self._next_id = 0
        self._arena: "Arena | bool | None" = None    # the store's registered arena; False: none
        self._logged: dict[tuple[str, str], tuple[float, int]] = {}
        self.acks = Acks(store, self.count)
        self.challenges = Challenges()     # NIXL challenges per key and per (key, endpoint)
        self.describer = Describer(store, lim.max_namespaces, self.count)
        # Every byte held for a host key: frames, replies, staging, feed books (budget.py).
        self.memory = Memory(lim.max_memory, lim.max_memory_per_key)
        self.feeds = Feeds(memory=self.memory)   # announced pages, per namespace (ANNOUNCE / FEED)
        # What each connection may use of the agent (never the server itself).
        self.ctx = AgentContext(
            name=self.name, store=store, access=self.access, acks=self.acks, limits=lim,
            memory=self.memory, describer=self.describer, feeds=self.feeds,
            challenges=self.challenges,
            count=self.count, warn=self.warn, say=self.say, counters=self.counters, admit=self.admit,
            release=self.release, direct=self.direct, stopping=lambda: self.stopping)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def warn(self, kind: str, tenant: str, msg: str, *args: object) -> None:
        """A WARNING line, rate-limited like every line a peer's input makes (`say`)."""
        self.say(kind, tenant, logging.WARNING, msg, *args)

    def say(self, kind: str, tenant: str, level: int, msg: str, *args: object,
            exc_info: bool = False) -> None:
        """Log a line at `level`, at most once per LOG_EVERY_S per kind and host key (`tenant`;
        "" for connections not yet authenticated): the one place every line a peer's input
        makes the agent write is logged (refusals, and since round 2 of issue 36 a connection
        made or reset, an endpoint proven, an internal error), so that one tenant's flood or
        reconnect churn neither floods the log nor silences another tenant's lines. Kinds are
        fixed strings and host keys those of the keys file: the table is bounded."""
        now = time.monotonic()
        with self._lock:
            last, skipped = self._logged.get((tenant, kind), (-LOG_EVERY_S, 0))
            if now - last < LOG_EVERY_S:
                self._logged[(tenant, kind)] = (last, skipped + 1)
                return
            self._logged[(tenant, kind)] = (now, 0)
        log.log(level, msg + (f" (and {skipped} more like it)" if skipped else ""), *args,
                exc_info=exc_info)

    def arena(self) -> "Arena | None":
        """The store's arena registered with NIXL (zero-copy moves), if the store has one."""
        from offload.agent.mover import Arena

        with self._lock:
            if self._arena is None and self.mover is not None:
                store = self.store
                region = store.arena_region() if isinstance(store, SlotStore) else None
                self._arena = Arena(self.mover, *region) if region is not None else False
            return self._arena if isinstance(self._arena, Arena) else None

    def direct(self) -> "Direct | None":
        """What the zero-copy moves need (`offload.agent.direct.direct_put/get`), if possible."""
        from offload.agent.direct import Direct

        arena = self.arena()
        if arena is None or self.mover is None or not isinstance(self.store, SlotStore):
            return None
        return Direct(self.store, arena, self.mover.agent, self.mover.quarantine, self.count,
                      self.mover.pool, self.warn)

    # ---------------------------------------------------------------- connections
    def admit(self, host: str) -> str | None:
        """A pending connection of `host` authenticated: None if it may stay (its tenant under
        `max_clients`), else why not (it then stays pending until `release(None)`)."""
        why = self.access.connect(host)
        if why is None:
            with self._lock:
                self._pending -= 1
        return why

    def release(self, host: str | None) -> None:
        """A connection ended: `host` if it was admitted, else None (still pending)."""
        if host is not None:
            self.access.disconnect(host)
        else:
            with self._lock:
                self._pending -= 1

    def start(self) -> None:
        if self.transport == "ucx":
            from offload.agent.mover import Mover

            self.mover = self.ctx.mover = Mover(self.name)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(128)
        self.port = sock.getsockname()[1]
        self._sock = sock
        log.info("agent %s listening on %s:%d (transport %s, %s)", self.name, self.host, self.port,
                 self.transport, self.access.mode)

    def serve_forever(self) -> None:
        assert self._sock is not None, "start() first"
        self._sock.settimeout(0.5)
        while not self.stopping:
            try:
                conn, addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self.stopping:
                    break
                self.count("accept_errors")
                self.warn("accept", "", "accept failed (%s); retrying in %.1fs", e.strerror or e,
                          ACCEPT_BACKOFF_S)
                time.sleep(ACCEPT_BACKOFF_S)
                continue
            self._serve(conn, f"{addr[0]}:{addr[1]}")

    def _serve(self, conn: socket.socket, peer: str) -> None:
        with self._lock:
            self._sessions = {k: t for k, t in self._sessions.items() if t.is_alive()}
            full = self._pending >= self.max_pending
            if not full:
                self._pending += 1
            self._next_id += 1
            conn_id = self._next_id
        if full:
            self.count("rejected_pending")
            self.warn("pending", "", "rejected %s: %d connections still authenticating", peer,
                      self.max_pending)
            conn.close()
            return
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = threading.Thread(target=Session(self.ctx, conn, peer, conn_id).run,
                                 name=f"agent-conn-{conn_id}", daemon=True)
            with self._lock:
                self._sessions[conn_id] = t
            t.start()
        except (OSError, RuntimeError) as e:     # no thread or socket left: drop this one
            self.release(None)
            self.count("accept_errors")
            self.warn("spawn", "", "cannot serve %s: %s", peer, e)
            conn.close()

    def stop(self) -> None:
        self.stopping = True
        self.acks.close()
        self.describer.close()
        if self.mover is not None:
            self.mover.close()
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass

    def join(self, timeout: float = 5.0) -> None:
        with self._lock:
            threads = list(self._sessions.values())
        for t in threads:
            t.join(timeout)
