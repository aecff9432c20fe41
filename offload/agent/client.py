"""The dpu path: `AgentStore`, a `BlockStore` whose blocks live on a remote agent (BlueField DPU).

Primitives: `AgentStore(address, secret, transport=..., timeout_s=..., name=...)`,
`AgentStore.from_config(cfg)`, `register_region(buffer)`. `name` is this host's name: with an
agent keys file (per-host credentials) it must be the host's entry there and `secret` its own
secret; it must match `protocol.HOST_PATTERN`. This process's NIXL agent is named `name/pid-id`
(the agent accepts NIXL metadata only under the authenticated host's name, and uses it only once
each connection proved the endpoint its own: `proof_nonces` collects the nonces the agent sends
to this NIXL agent, which the connection echoes, and `proof_area` holds the MAC of each, under
the connection's key, in registered memory while the agent reads it back through the endpoint).
Register the host KV pool once; then `put_many` / `get_many` on
buffers inside it send only keys and (address, length) descriptors, and the agent moves the bytes
itself with NIXL (READ from this host for a put, WRITE into it for a get), so this process copies
nothing. Buffers outside any registered region, or `transport="tcp"`, or an agent without NIXL:
the bytes travel on the control connection instead (vectored send, no extra copy on the way out).

A put's True means the agent has the blocks (written to its store, or being written from its
staging memory): stored unless that write or its commit fails, and invisible to every host (and
after a crash) until durable. `durable(keys)` asks the agent which
keys are durable, waiting for their commits (DURABLE); `flush()` does that for every key put True
since the last flush (remembered up to `FLUSH_KEYS`; past that the oldest are asked about first).

`announce(pages)` / `feed(ns, after)`: the agent's announcement feed (which block hash each
stored block holds, `offload.agent.feed`), read by the KV events of every host sharing it.

Failure model (data path, never raises): an unreachable, slow or killed agent makes every call a
miss (False / 0 / empty stats) within `timeout_s`: one deadline per call, covering the wait for a
free connection, opening it (handshake, HELLO, METADATA, PROVE, namespaces) and every request the
call makes; the connection is reset and retried after `reconnect_s`, re-sending this host's NIXL
metadata and namespaces. Each request carries a budget (80% of what is left of the call) after
which the agent stops touching this host's memory for it.

A GET over NIXL never hands the agent the caller's pages: the agent WRITEs into this store's own
registered landing area (`offload.agent.landing`), and the host copies each block into the
caller's pages after a good reply, then checks the agent's checksum on them. So a page reported
as a miss (False) is never written afterwards by the agent, however late it runs (stopped,
overloaded, a transfer posted before the deadline and finished after it): the area it may still
write into is held out of use (`Landing.hold`), and a late WRITE into an extent reused meanwhile
fails the checksum on the caller's pages (a miss) before it is reported loaded.

Parts: `HostNixl` (`offload.agent.host_nixl`: this process's NIXL agent, the memory it registered,
the proof and landing areas), `ConnPool` (`offload.agent.pool`: the connections, one lent per
call), `BlockCalls` (`offload.agent.calls`: PUT / GET of blocks, by NIXL or inline); `AgentStore`
keeps the keyed requests (EXISTS, DURABLE, DELETE, ANNOUNCE, FEED, REGISTER_NS, STATS) and what a
flush must ask about.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import re
import socket
import threading
import time
import uuid
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from offload.agent import protocol
from offload.agent.access import register_msg
from offload.agent.calls import BlockCalls, budget_ms
from offload.agent.conn import AgentConn, ConnHooks, ConnSettings, Down
from offload.agent.host_nixl import HostNixl
from offload.agent.landing import DEFAULT_BYTES as LANDING_BYTES
from offload.agent.landing import Landing
from offload.agent.pool import ConnPool
from offload.keys import Namespace
from offload.store.base import BlockStore, Buffer, StoreStats

if TYPE_CHECKING:
    from offload.config import OffloadConfig
    from offload.hw.decide import Decision

log = logging.getLogger(__name__)
FLUSH_KEYS = 1 << 16              # keys put since the last flush, remembered for it


class AgentStore:
    name = "dpu"

    def __init__(self, address: str, secret: bytes, *, transport: str = "ucx",
                 timeout_s: float = 5.0, reconnect_s: float = 1.0, name: str | None = None,
                 connections: int = 2, landing_bytes: int = LANDING_BYTES):
        host, _, port = address.rpartition(":")
        self.address = (host.strip("[]"), int(port))
        self.secret = secret
        self.transport = transport
        self.timeout_s = timeout_s
        self.reconnect_s = reconnect_s
        if name is not None and not re.match(protocol.HOST_PATTERN, name):
            from offload.errors import ConfigError

            raise ConfigError([f"agent host name {name!r}: use letters, digits and . _ @ : - "
                               "(up to 128)"])
        self.host_name = name or re.sub(
            r"[^A-Za-z0-9._@:-]", "_",
            f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}").lstrip("._@:-")[:128]
        self.nixl_name = f"{self.host_name}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.down_until = 0.0
        self._lock = threading.RLock()        # namespaces and what a flush asks about
        self._host = HostNixl(self.nixl_name, landing_bytes)
        settings = ConnSettings(self.address, secret, self.host_name, transport, timeout_s)
        hooks = ConnHooks(is_down=lambda: time.monotonic() < self.down_until,
                          mark_down=self.mark_down, nixl_metadata=self._host.metadata,
                          namespaces=self.namespaces, proof_nonces=self._host.proof_nonces,
                          proof_area=self._host.proof_area)
        self._pool = ConnPool(settings, hooks, connections)
        self._conns: list[AgentConn] = self._pool.conns
        self._released = self._pool.released
        # the budget looked up on the store at each request, as `_budget_ms` always was
        self._calls = BlockCalls(self._use, self._host, len(self._conns),
                                 lambda deadline: self._budget_ms(deadline))
        self._namespaces: dict[bytes, Namespace] = {}
        self._unflushed: dict[bytes, None] = {}      # put True since the last flush, in order
        self._lost = False                            # one of them was found not durable

    @classmethod
    def open(cls, cfg: OffloadConfig, decision: Decision | None = None,
             store: BlockStore | None = None) -> "AgentStore":
        """The dpu `TransferPath` (`offload.transfer.base.open_path`): blocks live on the agent."""
        return cls.from_config(cfg)

    @classmethod
    def from_config(cls, cfg: OffloadConfig) -> "AgentStore":
        """From an `OffloadConfig` (its `agent` section); reads the secret (ConfigError if none)."""
        from offload.agent.auth import load_secret
        from offload.errors import ConfigError

        a = cfg.agent
        if not a.address:
            raise ConfigError(["offload.agent.address: the dpu path needs HOST:PORT of the agent"])
        return cls(a.address, load_secret(a.secret_file), transport=a.transport,
                   timeout_s=a.timeout_s, name=a.host_name)

    # ---------------------------------------------------------------- registration (control path)
    def register_region(self, buffer: Any) -> None:
        """Register host memory (the host KV pool) with NIXL once; blocks inside it move by NIXL.

        No-op with transport "tcp". Raises PathUnavailableError if NIXL cannot be loaded.
        """
        if self.transport != "ucx":
            return
        self._host.register(buffer)
        self._pool.drop_all(wake=True)   # the next request says hello again, with the new metadata
        self.down_until = 0.0

    @property
    def _nixl(self) -> Any:
        """This process's NIXL agent (None until a region is registered)."""
        return self._host.agent

    @property
    def _landing(self) -> Landing | None:
        """Where GETs' NIXL WRITEs land (None until a region is registered)."""
        return self._host.landing

    @property
    def get_mismatch(self) -> int:
        """GET blocks whose bytes lacked the agent's checksum: misses."""
        return self._calls.get_mismatch

    # ---------------------------------------------------------------- connections
    def nixl_metadata(self) -> bytes | None:
        return self._host.metadata()

    def proof_nonces(self, tag: bytes, deadline: float) -> list[bytes]:
        """The nonces the agent sent this host's NIXL agent under `tag` (`HostNixl.proof_nonces`)."""
        return self._host.proof_nonces(tag, deadline)

    def namespaces(self) -> list[Namespace]:
        with self._lock:
            return list(self._namespaces.values())

    def mark_down(self, e: BaseException) -> None:
        if self.down_until <= time.monotonic():
            log.warning("agent %s:%d unreachable (%s); misses until it answers again",
                        *self.address, e)
        self.down_until = time.monotonic() + self.reconnect_s

    def _use(self, deadline: float | None = None
             ) -> AbstractContextManager[tuple[AgentConn | None, float]]:
        """A connection held for one call (`ConnPool.use`) and the call's deadline: `timeout_s`
        from now unless the caller's call already has one, which every step of the call shares."""
        return self._pool.use(deadline if deadline is not None else time.monotonic() + self.timeout_s)

    _budget_ms = staticmethod(budget_ms)   # a request's budget on the agent (80% of what is left)

    # ---------------------------------------------------------------- BlockStore
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]) -> list[bool]:
        """True: the agent has the block, durable soon (`durable`, `flush`). One deadline for
        the PUT and the durability check of older puts it may make."""
        deadline = time.monotonic() + self.timeout_s
        ok = self._calls.blocks(protocol.PUT, keys, blocks, deadline)
        with self._lock:
            self._unflushed.update((bytes(k), None) for k, f in zip(keys, ok) if f)
            full = len(self._unflushed) > FLUSH_KEYS       # ask about the oldest now
            old = list(itertools.islice(self._unflushed, protocol.MAX_KEYS)) if full else []
            for k in old:
                del self._unflushed[k]
        if old and not all(self.durable(old, deadline)):
            self._lost = True
        return ok

    def durable(self, keys: Sequence[bytes], deadline: float | None = None) -> list[bool]:
        """Per key, whether the agent stores it durably, once its puts so far were made durable
        or lost (the agent waits for them up to this request's budget); False while down or
        past `deadline` (a call's own, else `timeout_s` from now)."""
        out: list[bool] = []
        for n, reply in self._key_chunks(protocol.DURABLE, keys, lambda ks, d: protocol.Durable(
                ks, budget_ms=self._budget_ms(d)), deadline):
            flags = reply.ok if reply is not None else []
            out += [bool(f) for f in flags] if len(flags) == n else [False] * n
        return out

    def flush(self) -> bool:
        """Wait until every block this store put True since the last flush is durable on the
        agent; True if every one is (False if one was lost, or the agent is down)."""
        with self._lock:
            keys, self._unflushed = list(self._unflushed), {}
            lost, self._lost = self._lost, False
        return all(self.durable(keys)) and not lost

    def get_many(self, keys: Sequence[bytes], dests: Sequence[Sequence[Buffer]]) -> list[bool]:
        return self._calls.blocks(protocol.GET, keys, dests)

    def _key_chunks(self, op: int, keys: Sequence[bytes],
                    msg: Callable[[list[bytes], float], protocol.Msg] = (
                        lambda ks, d: protocol.KeyList(ks)),
                    deadline: float | None = None) -> Iterator[tuple[int, Any]]:
        """Send `op` (`msg(chunk, deadline)` of each chunk) over `keys` in chunks of
        `protocol.MAX_KEYS` on one connection, all within the call's one deadline: per chunk its
        length and the agent's reply (None while the agent is down or the deadline passed)."""
        with self._use(deadline) as (c, deadline):
            for start in range(0, len(keys), protocol.MAX_KEYS):
                chunk = list(keys[start:start + protocol.MAX_KEYS])
                reply = None
                if c is not None:
                    try:
                        reply = c.request(op, msg(chunk, deadline), None, deadline)[0]
                    except Down:
                        pass
                yield len(chunk), reply

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        out: list[bool] = []
        for n, reply in self._key_chunks(protocol.EXISTS, keys):
            out += reply.ok if reply is not None else [False] * n
        return out

    def clear(self, namespace: bytes | None = None) -> int:
        """Not offered by the agent protocol: blocks on the agent are evicted by its own cap, or
        cleared on the agent's host with `sglang-offload cache clear`."""
        log.warning("dpu: clear is done on the agent's host (sglang-offload cache clear)")
        return 0

    def delete_many(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            for k in keys:
                self._unflushed.pop(bytes(k), None)
        return sum(reply.n for _, reply in self._key_chunks(protocol.DELETE, keys)
                   if reply is not None)

    def announce(self, pages: Sequence[tuple[bytes, int, int | None]]) -> list[bool]:
        """Announce (block key, block hash, parent hash) of pages this host stored, for every
        host sharing the agent (ANNOUNCE); per page, recorded (False: the agent does not hold
        the block durably, or is down)."""
        out: list[bool] = []
        with self._use() as (c, deadline):
            for start in range(0, len(pages), protocol.MAX_KEYS):
                chunk = [(bytes(k), h, p) for k, h, p in pages[start:start + protocol.MAX_KEYS]]
                reply = None
                if c is not None:
                    try:
                        reply = c.request(protocol.ANNOUNCE, protocol.Announce(chunk), None,
                                          deadline)[0]
                    except Down:
                        pass
                flags = reply.ok if isinstance(reply, protocol.Flags) else []
                out += [bool(f) for f in flags] if len(flags) == len(chunk) else [False] * len(chunk)
        return out

    def feed(self, ns: bytes, after: int, limit: int = protocol.MAX_KEYS
             ) -> protocol.FeedPage | None:
        """The pages of namespace `ns` announced after cursor `after` (FEED); None while the
        agent is down or refuses (a namespace this host may not use)."""
        with self._use() as (c, deadline):
            if c is None:
                return None
            try:
                reply = c.request(protocol.FEED, protocol.FeedRead(bytes(ns), after, limit), None,
                                  deadline)[0]
            except Down:
                return None
        return reply if isinstance(reply, protocol.FeedPage) else None

    def register_namespace(self, ns: Namespace) -> None:
        with self._lock:
            self._namespaces[ns.digest()] = ns
        with self._use() as (c, deadline):
            try:
                if c is not None:
                    c.request(protocol.REGISTER_NS, register_msg(ns), None, deadline)
            except Down:
                pass   # sent again on reconnect

    def tier_stats(self) -> dict[str, StoreStats]:
        """The agent tier; its counters are agent-wide (every host's), none this process's own."""
        s = self.stats()
        s.extra["process_counters"] = ()
        return {"agent": s}

    def stats(self) -> StoreStats:
        names = {f.name for f in dataclasses.fields(StoreStats)} - {"extra"}
        with self._use() as (c, deadline):
            try:
                if c is None:
                    raise Down("no connection free before the call's deadline")
                fields = c.request(protocol.STATS, protocol.Empty(), None,
                                   deadline)[0].fields  # type: ignore[attr-defined]
            except Down:
                return StoreStats(extra={"agent": "unreachable"})
        s = StoreStats(**{k: v for k, v in fields.items() if k in names})
        s.extra = {k: v for k, v in fields.items() if k not in names}
        s.extra["agent"] = f"{self.address[0]}:{self.address[1]}"
        s.extra["host_get_mismatch"] = self.get_mismatch
        landing = self._landing                 # read once: close() may drop it meanwhile
        s.extra["host_landing_held_bytes"] = landing.held() if landing else 0
        return s
    def close(self) -> None:
        self._pool.drop_all()
        self._host.close()
