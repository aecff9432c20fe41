"""The storage agent: owns one block store and serves many inference hosts over TCP.

Primitives: `AgentServer(store, secret, host, port, ...)`; `.start()` binds and listens (port 0
picks a free one, `.port` tells which), `.serve_forever()` accepts until `.stop()`, each connection
served by its own thread (`offload.agent.session.Session`). With `transport="ucx"` one NIXL agent
(`offload.agent.mover.Mover`) moves the bytes of every host that registered its memory; with
"tcp" NIXL is never imported and bytes travel on the connections.
Limits: `max_clients` connections at once (more are closed at accept, logged), `max_body` bytes per
frame, `max_block` bytes per block, `staging_size` bytes of staging per NIXL connection.
A store with an arena and the slot API (the DRAM tier, `MemoryStore(reserve>0)`) gets it registered
with NIXL (`.arena()`), and its blocks move with no staging copy.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import Counter
from typing import TYPE_CHECKING

from offload.agent import protocol
from offload.agent.session import Session
from offload.store.base import BlockStore

if TYPE_CHECKING:
    from offload.agent.mover import Arena

log = logging.getLogger("offload.agent")


class AgentServer:
    def __init__(self, store: BlockStore, secret: bytes, host: str = "0.0.0.0", port: int = 0, *,
                 transport: str = "ucx", max_clients: int = 64, max_body: int = protocol.DEFAULT_MAX_BODY,
                 staging_size: int = 64 << 20, io_timeout: float = 30.0,
                 idle_timeout: float = 3600.0, name: str | None = None):
        self.store = store
        self.secret = secret
        self.host = host
        self.port = port
        self.transport = transport
        self.max_clients = max_clients
        self.max_body = int(max_body)
        self.staging_size = int(staging_size)
        self.max_block = min(staging_size // 2, max_body - (1 << 16))
        self.io_timeout = io_timeout
        self.idle_timeout = idle_timeout
        self.name = name or f"sglang-offload-agent-{socket.gethostname()}-{os.getpid()}"
        self.stopping = False
        self.mover = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()
        self._sessions: dict[int, threading.Thread] = {}
        self._next_id = 0
        self._arena: "Arena | bool | None" = None    # the store's registered arena; False: none

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def arena(self) -> "Arena | None":
        """The store's arena registered with NIXL (zero-copy moves), if the store has one."""
        from offload.agent.mover import Arena

        with self._lock:
            if self._arena is None and self.mover is not None:
                region = getattr(self.store, "arena_region", lambda: None)()
                ok = region is not None and hasattr(self.store, "reserve_views")
                self._arena = Arena(self.mover, *region) if ok else False
            return self._arena if isinstance(self._arena, Arena) else None

    def start(self) -> None:
        if self.transport == "ucx":
            from offload.agent.mover import Mover

            self.mover = Mover(self.name)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(128)
        self.port = sock.getsockname()[1]
        self._sock = sock
        log.info("agent %s listening on %s:%d (transport %s)", self.name, self.host, self.port,
                    self.transport)

    def serve_forever(self) -> None:
        assert self._sock is not None, "start() first"
        self._sock.settimeout(0.5)
        while not self.stopping:
            try:
                conn, addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self.stopping:
                    break
                raise
            peer = f"{addr[0]}:{addr[1]}"
            with self._lock:
                self._sessions = {k: t for k, t in self._sessions.items() if t.is_alive()}
                full = len(self._sessions) >= self.max_clients
                self._next_id += 1
                conn_id = self._next_id
            if full:
                self.count("rejected_full")
                log.warning("rejected %s: %d connections already (--max-clients)", peer,
                            self.max_clients)
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = threading.Thread(target=Session(self, conn, peer, conn_id).run,
                                 name=f"agent-conn-{conn_id}", daemon=True)
            with self._lock:
                self._sessions[conn_id] = t
            t.start()

    def stop(self) -> None:
        self.stopping = True
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
