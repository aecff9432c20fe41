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
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import logging
import os
import re
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from offload.agent import protocol, sums
from offload.agent.access import register_msg
from offload.agent.conn import AgentConn, ConnHooks, ConnSettings, Down, Refused
from offload.agent.landing import DEFAULT_BYTES as LANDING_BYTES
from offload.agent.landing import Landing
from offload.keys import Namespace
from offload.store.base import Buffer, StoreStats

log = logging.getLogger(__name__)
NIXL_BATCH_BYTES = 256 << 20      # bytes moved by one NIXL request (bounded work per deadline)
PROOF_SLOTS = 16                  # connections of this process proving their endpoint at once
FLUSH_KEYS = 1 << 16              # keys put since the last flush, remembered for it
_PROOF_SLOT = protocol.MAX_PROOF_NONCES * protocol.PROOF_MAC_BYTES


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
        self.get_mismatch = 0     # GET blocks whose bytes lacked the agent's checksum: misses
        self._lock = threading.RLock()        # registration state and namespaces
        settings = ConnSettings(self.address, secret, self.host_name, transport, timeout_s)
        hooks = ConnHooks(is_down=lambda: time.monotonic() < self.down_until,
                          mark_down=self.mark_down, nixl_metadata=self.nixl_metadata,
                          namespaces=self.namespaces, proof_nonces=self.proof_nonces,
                          proof_area=self.proof_area)
        # Several connections so that a prefetch (get) need not wait behind a backup (put).
        self._conns = [AgentConn(settings, hooks) for _ in range(max(1, connections))]
        self._released = threading.Condition()   # signalled when a connection is released
        self._nixl: Any = None
        self._regions: list[tuple[int, int]] = []   # registered [start, end)
        self._regs: list[Any] = []
        self._namespaces: dict[bytes, Namespace] = {}
        self._proofs: dict[bytes, list[bytes]] = {}   # proof tag -> nonces received (NIXL)
        self._proof_area: Any = None                   # registered: proof MACs, one slot each
        self._proof_free: list[int] = []
        self._unflushed: dict[bytes, None] = {}      # put True since the last flush, in order
        self._lost = False                            # one of them was found not durable
        self._landing_bytes = landing_bytes
        self._landing: Landing | None = None          # where GETs' NIXL WRITEs land

    @classmethod
    def open(cls, cfg: Any, decision: Any = None, store: Any = None) -> "AgentStore":
        """The dpu `TransferPath` (`offload.transfer.base.open_path`): blocks live on the agent."""
        return cls.from_config(cfg)

    @classmethod
    def from_config(cls, cfg: Any) -> "AgentStore":
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
        from offload.agent import nixl_util

        addr, size = nixl_util.region_of(buffer)
        with self._lock:
            if self._nixl is None:
                self._nixl = nixl_util.make_agent(self.nixl_name)
                self._register_proof_area()
                self._landing = Landing(self._landing_bytes)
                self._regs.append(self._landing.register(self._nixl))
            self._regs.append(self._nixl.register_memory([(addr, size, 0, "")], "DRAM"))
            self._regions.append((addr, addr + size))
        for c in self._conns:     # the next request says hello again, with the new metadata
            with c.lock:
                c.drop()
        with self._released:
            self._released.notify_all()
        self.down_until = 0.0

    def _register_proof_area(self) -> None:
        """Registered memory where a connection proving its endpoint puts its MACs (lock held)."""
        import numpy as np

        self._proof_area = np.zeros(PROOF_SLOTS * _PROOF_SLOT, np.uint8)
        self._regs.append(self._nixl.register_memory(
            [(self._proof_area.ctypes.data, self._proof_area.nbytes, 0, "")], "DRAM"))
        self._proof_free = list(range(PROOF_SLOTS))

    @contextmanager
    def proof_area(self, macs: list[bytes]) -> Iterator[int | None]:
        """Where `macs` lie, back to back, in registered memory while the agent reads them
        (PROVE); None when every slot is in use or NIXL is not loaded."""
        import numpy as np

        with self._lock:
            area = self._proof_area
            i = self._proof_free.pop() if area is not None and self._proof_free else None
        if i is None:
            yield None
            return
        view = area[i * _PROOF_SLOT:(i + 1) * _PROOF_SLOT]
        data = b"".join(macs)[:_PROOF_SLOT]
        try:
            view[:len(data)] = np.frombuffer(data, np.uint8)
            yield int(area.ctypes.data) + i * _PROOF_SLOT
        finally:
            view[:] = 0
            with self._lock:
                if self._proof_area is area:
                    self._proof_free.append(i)

    def _descs(self, bufs: Sequence[Any]) -> list[tuple[int, int]] | None:
        """(address, length) per buffer if all lie in registered memory, else None."""
        if not self._regions:
            return None
        from offload.agent.nixl_util import region_of

        out = []
        for b in bufs:
            try:
                addr, n = region_of(b)
            except (TypeError, ValueError):
                return None
            if n == 0:
                continue
            if not any(s <= addr and addr + n <= e for s, e in self._regions):
                return None
            out.append((addr, n))
        return out

    # ---------------------------------------------------------------- connections
    def nixl_metadata(self) -> bytes | None:
        with self._lock:
            return self._nixl.get_agent_metadata() if self._nixl is not None else None

    def proof_nonces(self, tag: bytes, deadline: float) -> list[bytes]:
        """The nonces the agent sent this host's NIXL agent under `tag` (a connection's proof
        tag), waiting for one until `deadline`. Notifications for other connections are kept
        for them (bounded); anything else is dropped."""
        prefix = protocol.PROOF_MAGIC + tag
        size = len(prefix) + protocol.PROOF_NONCE_BYTES
        while True:
            with self._lock:
                if self._nixl is None:
                    return []
                for msgs in self._nixl.get_new_notifs().values():
                    for m in msgs:
                        m = bytes(m)
                        if len(m) == size and m.startswith(protocol.PROOF_MAGIC):
                            got = self._proofs.setdefault(m[4:4 + protocol.PROOF_TAG_BYTES], [])
                            got.append(m[len(prefix):])
                            del got[:-protocol.MAX_PROOF_NONCES]
                while len(self._proofs) > 64:
                    self._proofs.pop(next(iter(self._proofs)))
                mine = self._proofs.pop(tag, [])
            if mine or time.monotonic() > deadline:
                return mine
            time.sleep(0.002)

    def namespaces(self) -> list[Namespace]:
        with self._lock:
            return list(self._namespaces.values())

    def mark_down(self, e: BaseException) -> None:
        if self.down_until <= time.monotonic():
            log.warning("agent %s:%d unreachable (%s); misses until it answers again",
                        *self.address, e)
        self.down_until = time.monotonic() + self.reconnect_s

    @contextmanager
    def _use(self, deadline: float | None = None) -> Iterator[tuple[AgentConn | None, float]]:
        """A free connection (else the first one released, waited for until the call's
        deadline: None if it passed), held for one call, and the call's deadline (`timeout_s`
        from now unless the caller's call already has one), which every step of the call shares."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        got: AgentConn | None = None
        with self._released:
            while got is None:
                got = next((c for c in self._conns if c.lock.acquire(blocking=False)), None)
                left = deadline - time.monotonic()
                if got is None and (left <= 0 or not self._released.wait(left)):
                    got = next((c for c in self._conns if c.lock.acquire(blocking=False)), None)
                    break
        if got is None:
            yield None, deadline
            return
        try:
            yield got, deadline
        finally:
            with self._released:
                got.lock.release()
                self._released.notify()

    @staticmethod
    def _budget_ms(deadline: float) -> int:
        """A request's budget on the agent: 80% of what is left of the call."""
        return max(1, int((deadline - time.monotonic()) * 800))

    # ---------------------------------------------------------------- BlockStore
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]) -> list[bool]:
        """True: the agent has the block, durable soon (`durable`, `flush`). One deadline for
        the PUT and the durability check of older puts it may make."""
        deadline = time.monotonic() + self.timeout_s
        ok = self._blocks(protocol.PUT, keys, blocks, deadline)
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
        return self._blocks(protocol.GET, keys, dests)

    def _blocks(self, op: int, keys: Sequence[bytes], bufs: Sequence[Sequence[Buffer]],
                deadline: float | None = None) -> list[bool]:
        ok = [False] * len(keys)
        with self._use(deadline) as (c, deadline):
            if c is None:
                return ok
            try:
                info = c.connect(deadline)
            except Down:
                return ok
            sizes = [sum(_nbytes(b) for b in bs) for bs in bufs]
            nixl_idx: list[int] = []
            inline_idx: list[int] = []
            descs: dict[int, list[tuple[int, int]]] = {}
            for i, bs in enumerate(bufs):
                if len(keys[i]) != 32 or sizes[i] > info.max_block:
                    continue
                d = self._descs(bs) if c.nixl else None
                if d is not None and len(d) <= protocol.MAX_DESCS_PER_BLOCK:
                    descs[i] = d
                    nixl_idx.append(i)
                else:
                    inline_idx.append(i)
            counts = [len(descs.get(i, ())) for i in range(len(keys))]
            if op == protocol.GET:
                return self._get_landed(c, deadline, keys, bufs, sizes, nixl_idx, inline_idx,
                                        descs, info, ok)
            for batch in protocol.pack(nixl_idx, sizes, NIXL_BATCH_BYTES, info.max_keys, counts):
                # A PUT's checksums travel in the MAC'd frame; the agent checks its READ by them.
                req = protocol.Blocks(keys=[keys[i] for i in batch], sizes=[sizes[i] for i in batch],
                               descs=[descs[i] for i in batch], budget_ms=self._budget_ms(deadline),
                               sums=[sums.of_regions(descs[i]) for i in batch])
                if not self._send_batch(c, deadline, op, req, batch, ok):
                    return ok
            self._inline(c, deadline, op, keys, bufs, sizes, inline_idx, info, ok)
        return ok

    def _inline(self, c: AgentConn, deadline: float, op: int, keys: Sequence[bytes],
                bufs: Sequence[Sequence[Buffer]], sizes: list[int], idx: list[int],
                info: protocol.HelloReply, ok: list[bool]) -> None:
        """Blocks `idx` with their bytes on the control connection (a GET's copied into the
        caller's buffers only from a good reply)."""
        room = info.max_body - (64 << 10)
        for batch in protocol.pack(idx, sizes, room, min(info.max_keys, room // 64)):
            req = protocol.Blocks(keys=[keys[i] for i in batch], sizes=[sizes[i] for i in batch],
                           budget_ms=self._budget_ms(deadline))
            payload = None
            if op == protocol.PUT:
                payload = [memoryview(b).cast("B") for i in batch for b in bufs[i]]
            if not self._send_batch(c, deadline, op, req, batch, ok, payload, bufs):
                return

    def _get_landed(self, c: AgentConn, deadline: float, keys: Sequence[bytes],
                    bufs: Sequence[Sequence[Buffer]], sizes: list[int], nixl_idx: list[int],
                    inline_idx: list[int], descs: dict[int, list[tuple[int, int]]],
                    info: protocol.HelloReply, ok: list[bool]) -> list[bool]:
        """A GET: NIXL WRITEs into the landing area only (never into `bufs`), each block copied
        into its buffers after a good reply (`_land`); blocks the area has no room for now travel
        inline. The extent of a request given up on is held (`Landing.hold`)."""
        landing = self._landing
        cap = NIXL_BATCH_BYTES if landing is None else min(
            NIXL_BATCH_BYTES, landing.size // len(self._conns))
        for batch in protocol.pack(nixl_idx, sizes, cap, info.max_keys):
            total = sum(sizes[i] for i in batch)
            base = landing.take(total) if landing is not None and total <= cap else None
            if landing is None or base is None:
                inline_idx.extend(batch)
                continue
            at, land = base, []
            for i in batch:
                land.append([(at, sizes[i])] if sizes[i] else [])
                at += sizes[i]
            req = protocol.Blocks(keys=[keys[i] for i in batch], sizes=[sizes[i] for i in batch],
                                  descs=land, budget_ms=self._budget_ms(deadline))
            answered = False
            try:
                answered = self._send_batch(c, deadline, protocol.GET, req, batch, ok,
                                            landed=[descs[i] for i in batch])
            finally:
                (landing.give if answered else landing.hold)(base)
            if not answered:
                return ok
        self._inline(c, deadline, protocol.GET, keys, bufs, sizes, sorted(inline_idx), info, ok)
        return ok

    def _send_batch(self, c: AgentConn, deadline: float, op: int, req: protocol.Blocks,
                    batch: list[int], ok: list[bool], payload: list[memoryview] | None = None,
                    bufs: Sequence[Sequence[Buffer]] | None = None,
                    landed: list[list[tuple[int, int]]] | None = None) -> bool:
        """Send one batch, set `ok` from its reply; False if the agent did not answer (the
        connection was reset). With `landed` (a GET through the landing area: the caller's
        regions of each block), blocks are copied from `req.descs` into them, then checked."""
        try:
            reply, data = c.request(op, req, payload, deadline)
        except Refused:
            return True
        except Down:
            return False
        flags = list(reply.ok)  # type: ignore[attr-defined]
        if len(flags) != len(batch):
            c.fail(protocol.ProtocolError("reply flags do not match the request"))
            return False
        if op == protocol.GET and req.descs is None and bufs is not None:
            expect = sum(s for s, f in zip(req.sizes, flags) if f)
            if data.nbytes != expect:
                c.fail(protocol.ProtocolError(f"reply payload {data.nbytes} bytes, expected {expect}"))
                return False
            off = 0
            for i, f in zip(batch, flags):
                if f:
                    for b in bufs[i]:
                        mv = memoryview(b).cast("B")
                        mv[:] = data[off:off + mv.nbytes]
                        off += mv.nbytes
        got = getattr(reply, "sums", None)
        if op == protocol.GET and req.descs is not None:
            # Copied into the caller's pages by this host, then checked there: what NIXL wrote
            # must have the checksum the agent sent beside it (and a late WRITE of an earlier
            # request into a reused landing extent fails it too).
            for k, f in enumerate(flags):
                if not f:
                    continue
                dst = landed[k] if landed is not None else req.descs[k]
                if landed is not None:
                    _copy(req.descs[k], dst)
                if got is None or len(got) != len(flags) or sums.of_regions(dst) != got[k]:
                    flags[k] = False
                    with self._lock:
                        self.get_mismatch += 1
        for i, f in zip(batch, flags):
            ok[i] = bool(f)
        return True

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
        for c in self._conns:
            with c.lock:
                c.drop()
        with self._lock:
            if self._nixl is not None:
                for reg in self._regs:
                    try:
                        self._nixl.deregister_memory(reg)
                    except Exception as e:  # noqa: BLE001
                        log.debug("deregistering host memory: %s", e)
                self._regs.clear()
                self._regions.clear()
                self._nixl = self._proof_area = self._landing = None


def _copy(src: Sequence[tuple[int, int]], dst: Sequence[tuple[int, int]]) -> None:
    """Copy the bytes at regions `src` (this process's memory) into regions `dst`, in order;
    both add up to the same length (one block)."""
    si, soff = 0, 0
    for daddr, dn in dst:
        while dn:
            saddr, sn = src[si]
            k = min(dn, sn - soff)
            ctypes.memmove(daddr, saddr + soff, k)
            daddr, dn, soff = daddr + k, dn - k, soff + k
            if soff == sn:
                si, soff = si + 1, 0


def _nbytes(buf: Any) -> int:
    """Bytes of one block buffer: a torch tensor (`data_ptr`) or anything with the buffer protocol."""
    if hasattr(buf, "data_ptr"):
        return int(buf.numel() * buf.element_size())
    return memoryview(buf).nbytes
