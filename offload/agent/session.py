"""One host connection on the agent: authenticate, then serve requests until it closes or errs.

Primitives: `Session(server, sock, peer).run()`. The first frame must be an authenticated HELLO
(host name, transport, NIXL metadata of the host's registered KV pool), small and complete within
`io_timeout` (`protocol.accept_hello`); only then does the connection count as a client
(`server.admit`). Then each request is one frame and gets one reply:
- PUT with descriptors: NIXL READs the blocks from host memory into staging (half A) while the
  store writes the previous group (half B); blocks the store already holds are not read at all.
  With a store arena (`server.arena()`) NIXL READs straight into reserved slots, committed after.
- GET with descriptors: the store reads a group into staging while NIXL WRITEs the previous group
  into host memory. A block is reported True only after its WRITE completed. With a store arena
  NIXL WRITEs straight from the pinned slots.
- PUT/GET without descriptors (`--transport tcp`, or memory the host did not register): the bytes
  travel as the frame payload.
- EXISTS, DELETE, STATS, REGISTER_NS (checked against the host's grants, `server.access`), METADATA
  (newer NIXL metadata of this connection; the peer it replaces is released).
Keys of a namespace the host is not entitled to make the whole request refused (ERROR reply).
A malformed, unauthenticated, oversized or truncated frame closes this connection only, logged
with the peer's address. Work stops at the request's deadline (its `budget_ms`) so that nothing is
written into host memory after the host has given up on the request.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Sequence

from offload.agent import nixl_util, protocol
from offload.agent.access import AccessError
from offload.agent.mover import direct_get, direct_put

if TYPE_CHECKING:
    from offload.agent.mover import Staging
    from offload.agent.server import AgentServer

log = logging.getLogger("offload.agent")


class RequestError(Exception):
    """An authenticated request that cannot be served; answered with ERROR, connection kept."""


class Session:
    def __init__(self, server: "AgentServer", sock: socket.socket, peer: str, conn_id: int):
        self.server = server
        self.sock = sock
        self.peer = peer
        self.conn_id = conn_id
        self.host = "?"
        self.admitted = False
        self.nixl_peer: str | None = None
        self.staging: "Staging | None" = None
        self._pool: ThreadPoolExecutor | None = None

    # ---------------------------------------------------------------- lifecycle
    def run(self) -> None:
        srv = self.server
        try:
            ch, frame = protocol.accept_hello(self.sock, srv.access.secret, srv.io_timeout,
                                              srv.max_body)
            hello = frame.decode(protocol.Hello)
            self.admitted = srv.admit()
            if not self.admitted:
                srv.count("rejected_full")
                srv.warn("full", "rejected %s (host %s): %d clients already (--max-clients)",
                         self.peer, hello.host, srv.max_clients)
                return
            self._hello(ch, hello, frame.req_id)
            while not srv.stopping:
                try:
                    frame = ch.recv(idle_timeout=srv.idle_timeout)
                except EOFError:
                    return
                self._dispatch(ch, frame)
        except protocol.AuthError as e:
            srv.count("rejected_auth")
            srv.warn("auth", "rejected %s (host %s): unauthenticated: %s", self.peer, self.host, e)
        except protocol.ProtocolError as e:
            srv.count("rejected_frame")
            srv.warn("frame" if self.admitted else "frame-pre-auth",
                     "rejected %s (host %s): bad frame: %s", self.peer, self.host, e)
        except TimeoutError:
            srv.count("timeouts")
            srv.warn("timeout" if self.admitted else "timeout-pre-auth",
                     "closed %s (host %s): timed out", self.peer, self.host)
        except (EOFError, OSError) as e:
            log.info("connection %s (host %s) ended: %s", self.peer, self.host, e)
        except Exception:  # noqa: BLE001 - one connection's bug must not stop the agent
            srv.count("internal_errors")
            log.exception("connection %s (host %s) failed", self.peer, self.host)
        finally:
            self.close()
            srv.release(self.admitted)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        if self.nixl_peer is not None and self.server.mover is not None:
            self.server.mover.drop_peer(self.nixl_peer, self.conn_id)
            self.nixl_peer = None
        try:
            self.sock.close()
        except OSError:
            pass

    # ---------------------------------------------------------------- requests
    def _hello(self, ch: protocol.Channel, hello: protocol.Hello, req_id: int) -> None:
        self.host = hello.host          # a safe name: protocol.HOST_PATTERN
        nixl_ok = False
        if hello.transport == "ucx" and hello.nixl_md and self.server.mover is not None:
            try:
                self.nixl_peer = self.server.mover.add_peer(hello.nixl_md, self.conn_id, self.host)
                nixl_ok = True
            except Exception as e:  # noqa: BLE001 - falls back to bytes on the connection
                log.warning("host %s (%s): NIXL metadata unusable, bytes will travel on the "
                            "control connection: %s", self.host, self.peer, e)
        log.info("host %s connected from %s (transport %s, nixl %s)", self.host, self.peer,
                 hello.transport, nixl_ok)
        ch.send(protocol.HELLO | protocol.REPLY, req_id, protocol.HelloReply(
            agent=self.server.name, max_body=self.server.max_body, max_keys=protocol.MAX_KEYS,
            max_block=self.server.max_block, nixl=nixl_ok))

    def _dispatch(self, ch: protocol.Channel, frame: protocol.Frame) -> None:
        op = frame.op
        typ = protocol.REQUEST_TYPES.get(op)
        if typ is None or op == protocol.HELLO:
            raise protocol.ProtocolError(f"unknown op {op}")
        msg = frame.decode(typ)
        store = self.server.store
        payload: list[memoryview] = []
        try:
            why = (self.server.access.refused(self.host, msg.keys)
                   if isinstance(msg, (protocol.Blocks, protocol.KeyList)) else None)
            if why is not None:
                raise RequestError(why)
            if op == protocol.PUT:
                reply: protocol.Msg = protocol.Flags(self._put(msg, frame.payload))   # type: ignore[arg-type]
            elif op == protocol.GET:
                flags, payload = self._get(msg)                          # type: ignore[arg-type]
                reply = protocol.Flags(flags)
            elif op == protocol.EXISTS:
                reply = protocol.Flags(store.exists_many(msg.keys))             # type: ignore[attr-defined]
            elif op == protocol.DELETE:
                reply = protocol.Count(store.delete_many(msg.keys))             # type: ignore[attr-defined]
            elif op == protocol.STATS:
                reply = protocol.StatsReply(self._stats())
            elif op == protocol.REGISTER_NS:
                try:
                    ns = self.server.access.register(self.host, msg)     # type: ignore[arg-type]
                except AccessError as e:
                    raise RequestError(str(e)) from None
                store.register_namespace(ns)
                reply = protocol.Empty()
            else:  # METADATA
                if self.server.mover is None:
                    raise RequestError("this agent runs without NIXL (--transport tcp)")
                md = msg.nixl_md                                         # type: ignore[attr-defined]
                try:
                    if self.nixl_peer is None:
                        self.nixl_peer = self.server.mover.add_peer(md, self.conn_id, self.host)
                    else:
                        self.nixl_peer = self.server.mover.update_peer(
                            self.nixl_peer, md, self.conn_id, self.host)
                except Exception as e:  # noqa: BLE001
                    raise RequestError(f"NIXL metadata unusable: {e}") from None
                reply = protocol.Empty()
        except RequestError as e:
            self.server.count("bad_requests")
            log.warning("host %s (%s): %s request refused: %s", self.host, self.peer,
                        protocol.OP_NAMES[op], e)
            ch.send(protocol.ERROR | protocol.REPLY, frame.req_id, protocol.ErrorReply(str(e)))
            return
        self.server.count(protocol.OP_NAMES[op])
        ch.send(op | protocol.REPLY, frame.req_id, reply, payload)

    def _stats(self) -> dict[str, int | float | str]:
        s = self.server.store.stats()
        out: dict[str, int | float | str] = {}
        for f in dataclasses.fields(s):
            v = getattr(s, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f.name] = v if type(v) in (int, float) else (
                    int(v) if isinstance(v, int) else float(v))
        out.update({f"agent_{k}": v for k, v in self.server.counters().items()})
        if self.server.mover is not None:
            out["agent_nixl_peers"] = self.server.mover.peers()
        return out

    def _check(self, req: protocol.Blocks) -> None:
        n = len(req.keys)
        if len(req.sizes) != n or (req.descs is not None and len(req.descs) != n):
            raise RequestError(f"{n} keys but {len(req.sizes)} sizes / "
                               f"{len(req.descs or [])} descriptor lists")
        for size in req.sizes:
            if size > self.server.max_block:
                raise RequestError(f"block of {size} bytes exceeds the agent's limit "
                                   f"{self.server.max_block}")
        if req.descs is not None:
            total = sum(len(d) for d in req.descs)
            if total > protocol.MAX_DESCS_PER_REQUEST:
                raise RequestError(f"{total} descriptors in one request; the limit is "
                                   f"{protocol.MAX_DESCS_PER_REQUEST}")
            for size, descs in zip(req.sizes, req.descs):
                if sum(d[1] for d in descs) != size:
                    raise RequestError("descriptor lengths do not add up to the block size")
            if self.nixl_peer is None:
                raise RequestError("descriptors sent but this connection does not use NIXL")

    def _groups(self, idx: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
        """Pack block indices into groups that fit one staging half, about four per request
        (so that NIXL and the store overlap even when the whole request would fit one half)."""
        assert self.staging is not None
        idx = list(idx)
        total = sum(sizes[i] for i in idx)
        largest = max((sizes[i] for i in idx), default=0)
        limit = min(self.staging.half_size, max(largest, total // 4))
        return protocol.pack(idx, sizes, limit)

    def _staging(self) -> "Staging":
        if self.staging is None:
            from offload.agent.mover import Staging

            assert self.server.mover is not None
            self.staging = Staging(self.server.mover, self.server.staging_size)
        return self.staging

    def _put(self, req: protocol.Blocks, payload: memoryview) -> list[bool]:
        self._check(req)
        store = self.server.store
        if req.descs is None:
            if sum(req.sizes) != payload.nbytes:
                raise RequestError(f"payload of {payload.nbytes} bytes, sizes add up to "
                                   f"{sum(req.sizes)}")
            blocks, off = [], 0
            for size in req.sizes:
                blocks.append([payload[off:off + size]])
                off += size
            self.server.count("bytes_inline_in", payload.nbytes)
            return store.put_many(req.keys, blocks)
        deadline = time.monotonic() + req.budget_ms / 1000.0
        present = store.exists_many(req.keys)
        ok = list(present)
        todo = [i for i, p in enumerate(present) if not p]
        todo = direct_put(self.server.direct(), self.nixl_peer, req, todo, ok, deadline)
        if not todo:
            return ok
        staging = self._staging()
        writing: list[Future | None] = [None, None]     # store write in flight, per half
        for g, group in enumerate(self._groups(todo, req.sizes)):
            h = g % 2
            self._collect(writing[h], ok)                # this half's previous group is stored
            writing[h] = None
            view, base = staging.half(h)
            local, remote, off = self._pairs(req, group, base)
            if time.monotonic() > deadline or not nixl_util.run_xfer(
                    self.server.mover.agent, "READ", local, remote, self.nixl_peer, deadline):
                break
            self.server.count("bytes_nixl_in", off)
            self.server.count("blocks_staged_in", len(group))
            blocks, off = [], 0
            for i in group:
                blocks.append([view[off:off + req.sizes[i]]])
                off += req.sizes[i]
            # The store writes this group while NIXL reads the next one into the other half.
            writing[h] = self._io().submit(self._store_put, [req.keys[i] for i in group],
                                           blocks, group)
        for fut in writing:
            self._collect(fut, ok)
        return ok

    def _store_put(self, keys: list[bytes], blocks: list, group: list[int]
                   ) -> list[tuple[int, bool]]:
        return list(zip(group, self.server.store.put_many(keys, blocks)))

    @staticmethod
    def _collect(fut: "Future | None", ok: list[bool]) -> None:
        if fut is None:
            return
        try:
            for i, flag in fut.result():
                ok[i] = flag
        except Exception as e:  # noqa: BLE001 - the store never raises; be sure of it
            log.warning("store call failed: %s", e)

    def _pairs(self, req: protocol.Blocks, group: Sequence[int], base: int,
               offs: Sequence[int] | None = None) -> tuple[list, list, int]:
        """Matching (local staging, remote host) descriptor lists for a group of blocks."""
        local, remote, off = [], [], 0
        for k, i in enumerate(group):
            o = offs[k] if offs is not None else off
            for addr, n in req.descs[i]:           # type: ignore[index]
                local.append((base + o, n))
                remote.append((addr, n))
                o += n
            off += req.sizes[i]
        return local, remote, off

    def _io(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"agent-io-{self.conn_id}")
        return self._pool

    def _get(self, req: protocol.Blocks) -> tuple[list[bool], list[memoryview]]:
        self._check(req)
        store = self.server.store
        if req.descs is None:
            total = sum(req.sizes)
            if total + 4096 > self.server.max_body:
                raise RequestError(f"reply of {total} bytes would exceed the frame limit")
            buf = memoryview(bytearray(total))
            dests, off = [], 0
            for size in req.sizes:
                dests.append([buf[off:off + size]])
                off += size
            flags = store.get_many(req.keys, dests)
            out = [d[0] for d, f in zip(dests, flags) if f]
            self.server.count("bytes_inline_out", sum(v.nbytes for v in out))
            return flags, out
        deadline = time.monotonic() + req.budget_ms / 1000.0
        ok = [False] * len(req.keys)
        rest = direct_get(self.server.direct(), self.nixl_peer, req, ok, deadline)
        if not rest:
            return ok, []
        staging = self._staging()
        groups = self._groups(rest, req.sizes)
        reading = self._io().submit(self._store_get, req, groups[0], 0) if groups else None
        for g, group in enumerate(groups):
            assert reading is not None
            try:
                flags, offs = reading.result()
            except Exception as e:  # noqa: BLE001
                log.warning("store read failed: %s", e)
                break
            # The store reads the next group into the other half while NIXL writes this one.
            reading = (self._io().submit(self._store_get, req, groups[g + 1], (g + 1) % 2)
                       if g + 1 < len(groups) and time.monotonic() < deadline else None)
            hits = [i for i, f in zip(group, flags) if f]
            if not hits or time.monotonic() > deadline:
                continue
            _, base = staging.half(g % 2)
            local, remote, nbytes = self._pairs(req, hits, base,
                                                [o for o, f in zip(offs, flags) if f])
            if nixl_util.run_xfer(self.server.mover.agent, "WRITE", local, remote,
                                  self.nixl_peer, deadline):
                self.server.count("bytes_nixl_out", nbytes)
                self.server.count("blocks_staged_out", len(hits))
                for i in hits:
                    ok[i] = True
        if reading is not None:
            try:
                reading.result()     # never leave a read into staging running past this request
            except Exception:  # noqa: BLE001 - already logged or irrelevant now
                pass
        return ok, []

    def _store_get(self, req: protocol.Blocks, group: list[int], half: int
                   ) -> tuple[list[bool], list[int]]:
        view, _ = self.staging.half(half)   # type: ignore[union-attr]
        dests, offs, off = [], [], 0
        for i in group:
            dests.append([view[off:off + req.sizes[i]]])
            offs.append(off)
            off += req.sizes[i]
        return self.server.store.get_many([req.keys[i] for i in group], dests), offs
