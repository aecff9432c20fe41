"""The dpu path: `AgentStore`, a `BlockStore` whose blocks live on a remote agent (BlueField DPU).

Primitives: `AgentStore(address, secret, transport=..., timeout_s=...)`, `AgentStore.from_config(
cfg)`, `register_region(buffer)`. Register the host KV pool once; then `put_many` / `get_many` on
buffers inside it send only keys and (address, length) descriptors, and the agent moves the bytes
itself with NIXL (READ from this host for a put, WRITE into it for a get), so this process copies
nothing. Buffers outside any registered region, or `transport="tcp"`, or an agent without NIXL:
the bytes travel on the control connection instead (vectored send, no extra copy on the way out).

Failure model (data path, never raises): an unreachable, slow or killed agent makes every call a
miss (False / 0 / empty stats) within `timeout_s`; the connection is dropped and retried after
`reconnect_s`, re-sending this host's NIXL metadata and namespaces. Each request carries a budget
(80% of `timeout_s`) after which the agent stops touching this host's memory for it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Sequence

from offload.agent import protocol as P
from offload.keys import Namespace
from offload.store.base import Buffer, StoreStats

log = logging.getLogger(__name__)
NIXL_BATCH_BYTES = 256 << 20      # bytes moved by one NIXL request (bounded work per deadline)


class _Down(Exception):
    """The agent cannot be used right now (the call is a miss)."""


class _Refused(_Down):
    """The agent answered ERROR to one request; the connection stays usable."""


class AgentStore:
    name = "dpu"

    def __init__(self, address: str, secret: bytes, *, transport: str = "ucx",
                 timeout_s: float = 5.0, reconnect_s: float = 1.0, name: str | None = None):
        host, _, port = address.rpartition(":")
        self.address = (host.strip("[]"), int(port))
        self.secret = secret
        self.transport = transport
        self.timeout_s = timeout_s
        self.reconnect_s = reconnect_s
        self.host_name = name or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.RLock()
        self._ch: P.Channel | None = None
        self._info: P.HelloReply | None = None
        self._down_until = 0.0
        self._req_id = 0
        self._nixl: Any = None
        self._regions: list[tuple[int, int]] = []   # registered [start, end)
        self._regs: list[Any] = []
        self._namespaces: dict[bytes, Namespace] = {}

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
                   timeout_s=a.timeout_s)

    # ---------------------------------------------------------------- registration (control path)
    def register_region(self, buffer: Any) -> None:
        """Register host memory (the host KV pool) with NIXL once; blocks inside it move by NIXL.

        No-op with transport "tcp". Raises PathUnavailableError if NIXL cannot be loaded.
        """
        if self.transport != "ucx":
            return
        from offload.transfer import nixl_util

        addr, size = nixl_util.region_of(buffer)
        with self._lock:
            if self._nixl is None:
                self._nixl = nixl_util.make_agent(self.host_name)
            self._regs.append(self._nixl.register_memory([(addr, size, 0, "")], "DRAM"))
            self._regions.append((addr, addr + size))
            self._drop()          # the next request says hello again, with the new metadata
            self._down_until = 0.0

    def _descs(self, bufs: Sequence[Any]) -> list[tuple[int, int]] | None:
        """(address, length) per buffer if all lie in registered memory, else None."""
        if not self._regions:
            return None
        from offload.transfer.nixl_util import region_of

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

    # ---------------------------------------------------------------- connection
    def _connect(self) -> P.Channel:
        if self._ch is not None:
            return self._ch
        if time.monotonic() < self._down_until:
            raise _Down("agent marked down")
        try:
            sock = socket.create_connection(self.address, timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ch = P.handshake_client(sock, self.secret, self.timeout_s)
            self._ch = ch
            md = self._nixl.get_agent_metadata() if self._nixl is not None else None
            info = self._request(P.HELLO, P.Hello(host=self.host_name, transport=self.transport,
                                                  nixl_md=md))[0]
            assert isinstance(info, P.HelloReply)
            self._info = info
            ch.max_body = info.max_body
            if md is not None and not info.nixl:
                log.warning("agent %s:%d does not move bytes by NIXL; they travel on the "
                            "control connection", *self.address)
            for ns in self._namespaces.values():
                self._request(P.REGISTER_NS, P.NamespaceMsg(dataclasses.asdict(ns)))
            log.info("connected to agent %s at %s:%d", info.agent, *self.address)
            return ch
        except _Down:
            raise
        except (OSError, P.ProtocolError, EOFError) as e:
            self._fail(e)
            raise _Down(str(e)) from None

    def _drop(self) -> None:
        if self._ch is not None:
            try:
                self._ch.sock.close()
            except OSError:
                pass
        self._ch = None

    def _fail(self, e: BaseException) -> None:
        if self._down_until <= time.monotonic():
            log.warning("agent %s:%d unreachable (%s); misses until it answers again",
                        *self.address, e)
        self._drop()
        self._down_until = time.monotonic() + self.reconnect_s

    def _request(self, op: int, msg: P.Msg, payload: list[memoryview] | None = None
                 ) -> tuple[P.Msg, memoryview]:
        """Send one request and read its reply (lock held). Raises _Down on any failure."""
        ch = self._ch if op == P.HELLO else self._connect()
        assert ch is not None
        self._req_id += 1
        try:
            ch.send(op, self._req_id, msg, payload)
            frame = ch.recv(idle_timeout=self.timeout_s)
            if frame.req_id != self._req_id:
                raise P.ProtocolError(f"reply to request {frame.req_id}, expected {self._req_id}")
            if frame.op == P.ERROR | P.REPLY:
                err = frame.decode(P.ErrorReply)
                log.warning("agent refused %s: %s", P.OP_NAMES.get(op, op), err.message)
                raise _Refused(err.message)
            if frame.op != op | P.REPLY:
                raise P.ProtocolError(f"reply op {frame.op} to op {op}")
            return frame.decode(P.REPLY_TYPES[op]), frame.payload
        except _Down:
            raise
        except (OSError, P.ProtocolError, EOFError) as e:
            self._fail(e)
            raise _Down(str(e)) from None

    def _budget_ms(self) -> int:
        return max(1, int(self.timeout_s * 800))

    # ---------------------------------------------------------------- BlockStore
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]) -> list[bool]:
        return self._blocks(P.PUT, keys, blocks)

    def get_many(self, keys: Sequence[bytes], dests: Sequence[Sequence[Buffer]]) -> list[bool]:
        return self._blocks(P.GET, keys, dests)

    def _blocks(self, op: int, keys: Sequence[bytes], bufs: Sequence[Sequence[Buffer]]
                ) -> list[bool]:
        ok = [False] * len(keys)
        with self._lock:
            try:
                self._connect()
            except _Down:
                return ok
            info = self._info
            assert info is not None
            sizes = [sum(memoryview(b).nbytes if not hasattr(b, "data_ptr")
                         else b.numel() * b.element_size() for b in bs) for bs in bufs]
            nixl_idx: list[int] = []
            inline_idx: list[int] = []
            descs: dict[int, list[tuple[int, int]]] = {}
            for i, bs in enumerate(bufs):
                if len(keys[i]) != 32 or sizes[i] > info.max_block:
                    continue
                d = self._descs(bs) if info.nixl else None
                if d is not None and len(d) <= P.MAX_DESCS_PER_BLOCK:
                    descs[i] = d
                    nixl_idx.append(i)
                else:
                    inline_idx.append(i)
            for batch in _batches(nixl_idx, sizes, info.max_keys, NIXL_BATCH_BYTES):
                req = P.Blocks(keys=[keys[i] for i in batch], sizes=[sizes[i] for i in batch],
                               descs=[descs[i] for i in batch], budget_ms=self._budget_ms())
                if not self._send_batch(op, req, batch, ok):
                    return ok
            room = info.max_body - (64 << 10)
            for batch in _batches(inline_idx, sizes, min(info.max_keys, room // 64), room):
                req = P.Blocks(keys=[keys[i] for i in batch], sizes=[sizes[i] for i in batch],
                               budget_ms=self._budget_ms())
                payload = None
                if op == P.PUT:
                    payload = [memoryview(b).cast("B") for i in batch for b in bufs[i]]
                if not self._send_batch(op, req, batch, ok, payload, bufs):
                    return ok
        return ok

    def _send_batch(self, op: int, req: P.Blocks, batch: list[int], ok: list[bool],
                    payload: list[memoryview] | None = None,
                    bufs: Sequence[Sequence[Buffer]] | None = None) -> bool:
        try:
            reply, data = self._request(op, req, payload)
        except _Refused:
            return True
        except _Down:
            return False
        flags = reply.ok  # type: ignore[attr-defined]
        if len(flags) != len(batch):
            self._fail(P.ProtocolError("reply flags do not match the request"))
            return False
        if op == P.GET and req.descs is None and bufs is not None:
            expect = sum(s for s, f in zip(req.sizes, flags) if f)
            if data.nbytes != expect:
                self._fail(P.ProtocolError(f"reply payload {data.nbytes} bytes, expected {expect}"))
                return False
            off = 0
            for i, f in zip(batch, flags):
                if f:
                    for b in bufs[i]:
                        mv = memoryview(b).cast("B")
                        mv[:] = data[off:off + mv.nbytes]
                        off += mv.nbytes
        for i, f in zip(batch, flags):
            ok[i] = bool(f)
        return True

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        out: list[bool] = []
        with self._lock:
            for start in range(0, len(keys), P.MAX_KEYS):
                chunk = list(keys[start:start + P.MAX_KEYS])
                try:
                    out += self._request(P.EXISTS, P.KeyList(chunk))[0].ok  # type: ignore[attr-defined]
                except _Down:
                    out += [False] * len(chunk)
        return out

    def delete_many(self, keys: Sequence[bytes]) -> int:
        n = 0
        with self._lock:
            for start in range(0, len(keys), P.MAX_KEYS):
                try:
                    n += self._request(P.DELETE, P.KeyList(list(keys[start:start + P.MAX_KEYS])))[
                        0].n  # type: ignore[attr-defined]
                except _Down:
                    pass
        return n

    def register_namespace(self, ns: Namespace) -> None:
        with self._lock:
            self._namespaces[ns.digest()] = ns
            try:
                self._request(P.REGISTER_NS, P.NamespaceMsg(dataclasses.asdict(ns)))
            except _Down:
                pass   # sent again on reconnect

    def stats(self) -> StoreStats:
        names = {f.name for f in dataclasses.fields(StoreStats)} - {"extra"}
        with self._lock:
            try:
                fields = self._request(P.STATS, P.Empty())[0].fields  # type: ignore[attr-defined]
            except _Down:
                return StoreStats(extra={"agent": "unreachable"})
        s = StoreStats(**{k: v for k, v in fields.items() if k in names})
        s.extra = {k: v for k, v in fields.items() if k not in names}
        s.extra["agent"] = f"{self.address[0]}:{self.address[1]}"
        return s

    def close(self) -> None:
        with self._lock:
            self._drop()
            if self._nixl is not None:
                for reg in self._regs:
                    try:
                        self._nixl.deregister_memory(reg)
                    except Exception as e:  # noqa: BLE001
                        log.debug("deregistering host memory: %s", e)
                self._regs.clear()
                self._regions.clear()
                self._nixl = None


def _batches(idx: list[int], sizes: list[int], max_keys: int, max_bytes: int) -> list[list[int]]:
    out: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in idx:
        if cur and (len(cur) >= max_keys or used + sizes[i] > max_bytes):
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += sizes[i]
    if cur:
        out.append(cur)
    return out
