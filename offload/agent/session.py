"""One host connection on the agent: authenticate, then serve requests until it closes or errs.

Primitives: `Session(ctx, sock, peer, conn_id).run()` (`ctx`: the agent's
`offload.agent.context.AgentContext`). The first frame must be an authenticated HELLO
(host name, transport, NIXL metadata of the host's registered KV pool), small and complete within
`io_timeout` (`protocol.accept_hello`); only then does the connection count as a client
(`ctx.admit`). Then each request is one frame and gets one reply; what each request does is
described with the wire protocol, in `offload.agent.protocol` ("Requests").
Keys of a namespace the host is not entitled to make the whole request refused (ERROR reply).
A malformed, unauthenticated, oversized or truncated frame closes this connection only, logged
with the peer's address. Work stops at the request's deadline (its `budget_ms`, counted from when
the frame is read), which saves work but does not bound when a WRITE already posted lands, nor
when a frame is read (a stopped agent reads it late): that a page the host reported as a miss is
never written afterwards is kept by the host, whose GETs name only its own landing area
(`offload.agent.landing`).

Parts, each given the session: `Endpoint` (`offload.agent.endpoint`: the connection's NIXL
endpoint, its metadata charged, loaded, challenged and proven; the quarantine's room) and
`PutGet` (`offload.agent.put_get`: PUT / GET of blocks, their bounds checked). The session keeps
the lifecycle, the charging of each frame and reply to the host key (`_admit_frame`, `_dispatch`),
and the keyed requests (EXISTS, DURABLE, DELETE, ANNOUNCE, FEED, REGISTER_NS, STATS).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from typing import TYPE_CHECKING, Sequence

from offload.agent import protocol
from offload.agent.access import AccessError
from offload.agent.endpoint import Endpoint
from offload.agent.feed import Page
from offload.agent.put_get import PutGet
from offload.agent.refused import RequestError
from offload.agent.staged import StagedPath
from offload.keys import NS_BYTES

if TYPE_CHECKING:
    from offload.agent.context import AgentContext

log = logging.getLogger("offload.agent")


class Session:
    def __init__(self, ctx: "AgentContext", sock: socket.socket, peer: str, conn_id: int):
        self.ctx = ctx
        self.sock = sock
        self.peer = peer
        self.conn_id = conn_id
        self.host = "?"
        self.admitted = False
        self.ch: protocol.Channel | None = None
        self._described: set[bytes] = set()    # namespaces described to the store
        self.staged = StagedPath(ctx, conn_id)
        self._frame_bytes = 0                  # charged for the request being served and its
                                               # reply (ctx.memory), given back once it is sent
        self.endpoint = Endpoint(self)         # its NIXL endpoint: loaded, challenged, proven
        self.blocks = PutGet(self)             # its PUT / GET of blocks

    # ---------------------------------------------------------------- lifecycle
    def run(self) -> None:
        srv = self.ctx
        try:
            ch, frame = protocol.accept_hello(self.sock, srv.access.secret, srv.limits.io_timeout,
                                              srv.limits.max_body)
            hello = frame.decode(protocol.Hello)
            why = srv.admit(hello.host)
            if why is not None:
                srv.count("rejected_full")
                srv.warn("full", srv.access.tenant(hello.host),
                         "rejected %s (host %s): %s (--max-clients)", self.peer, hello.host, why)
                return
            self.admitted = True
            self.ch = ch
            self.staged.owner = srv.access.tenant(hello.host)
            self._take(protocol.ERROR_REPLY_BOUND)           # the HelloReply (or a close)
            try:
                self._hello(ch, hello, frame.req_id)
            finally:
                self._release_frame()
            ch.admit = self._admit_frame
            while not srv.stopping():
                try:
                    frame = ch.recv(idle_timeout=srv.limits.idle_timeout)
                except EOFError:
                    return
                try:
                    self._dispatch(ch, frame)
                finally:
                    self._release_frame()
        except protocol.AuthError as e:
            srv.count("rejected_auth")
            srv.warn("auth", "", "rejected %s (host %s): unauthenticated: %s", self.peer, self.host, e)
        except protocol.ProtocolError as e:
            srv.count("rejected_frame")
            srv.warn("frame", self.staged.owner if self.admitted else "",
                     "rejected %s (host %s): bad frame: %s", self.peer, self.host, e)
        except TimeoutError:
            srv.count("timeouts")
            srv.warn("timeout", self.staged.owner if self.admitted else "",
                     "closed %s (host %s): timed out", self.peer, self.host)
        except (EOFError, OSError) as e:
            if not self.admitted and isinstance(e, (EOFError, ConnectionResetError,
                                                    BrokenPipeError)):
                # A reachability probe (`sglang-offload detect`) connects and closes at once.
                log.debug("connection %s closed before authenticating: %s", self.peer, e)
            else:
                srv.say("ended", self.staged.owner if self.admitted else "", logging.INFO,
                        "connection %s (host %s) ended: %s", self.peer, self.host, e)
        except Exception:  # noqa: BLE001 - one connection's bug must not stop the agent
            srv.count("internal_errors")
            srv.say("internal", self.staged.owner if self.admitted else "", logging.ERROR,
                    "connection %s (host %s) failed", self.peer, self.host, exc_info=True)
        finally:
            self.close()
            srv.release(self.host if self.admitted else None)

    def _admit_frame(self, n: int) -> None:
        """A request frame's body (and its MAC, read with it) is allocated only within the
        agent's memory bound, with room for an ERROR reply (the rest of its reply is charged
        once it is decoded: `_dispatch`)."""
        self._take(n + protocol.MAC_BYTES + protocol.ERROR_REPLY_BOUND)

    def _take(self, n: int) -> None:
        """Charge `n` more bytes of this request to the host key (before they are allocated);
        given back by `_release_frame` once its reply is written. Raises ProtocolError past it."""
        why = self._charge(n)
        if why is not None:
            self.ctx.warn("memory", self.staged.owner, "host %s (%s): %d bytes refused: %s",
                          self.host, self.peer, n, why)
            raise protocol.ProtocolError(f"{n} bytes refused: {why}")

    def _charge(self, n: int) -> str | None:
        """`_take` without raising: None, or why not (counted)."""
        why = self.ctx.memory.take(self.staged.owner, n)
        if why is not None:
            self.ctx.count("rejected_memory")
            return why
        self._frame_bytes += n
        return None

    def _release_frame(self) -> None:
        n, self._frame_bytes = self._frame_bytes, 0
        if n:
            self.ctx.memory.give(self.staged.owner, n)

    def close(self) -> None:
        self._release_frame()
        self.staged.close()
        self.endpoint.drop()
        mover = self.ctx.mover
        if mover is not None:
            mover.quarantine.reap()
        try:
            self.sock.close()
        except OSError:
            pass

    # ---------------------------------------------------------------- requests
    def _hello(self, ch: protocol.Channel, hello: protocol.Hello, req_id: int) -> None:
        self.host = hello.host          # a safe name: protocol.HOST_PATTERN
        nixl_ok = False
        if hello.transport == "ucx" and hello.nixl_md and self.ctx.mover is not None:
            try:
                self.endpoint.load(hello.nixl_md)
                nixl_ok = True
            except Exception as e:  # noqa: BLE001 - falls back to bytes on the connection
                self.ctx.warn("hello-metadata", self.staged.owner,
                              "host %s (%s): NIXL metadata unusable, bytes will travel on the "
                              "control connection: %s", self.host, self.peer, e)
        self.ctx.say("connected", self.staged.owner, logging.INFO,
                     "host %s connected from %s (transport %s, nixl %s)", self.host, self.peer,
                     hello.transport, nixl_ok)
        self._sent(ch.send(protocol.HELLO | protocol.REPLY, req_id, protocol.HelloReply(
            agent=self.ctx.name, max_body=self.ctx.limits.max_body, max_keys=protocol.MAX_KEYS,
            max_block=self.ctx.limits.max_block, nixl=nixl_ok, proof_tag=self.endpoint.proof_tag)))

    def _sent(self, n: int) -> None:
        """A reply of `n` bytes was written: counted if more than its charge (the invariant:
        every byte held for a key is charged first; `tests/agent/test_memory_charge.py`)."""
        if n > self._frame_bytes:
            self.ctx.count("uncharged_bytes", n - self._frame_bytes)
            self.ctx.warn("uncharged", self.staged.owner, "host %s: a reply of %d bytes "
                          "exceeded its charge of %d", self.host, n, self._frame_bytes)

    def _dispatch(self, ch: protocol.Channel, frame: protocol.Frame) -> None:
        op = frame.op
        typ = protocol.REQUEST_TYPES.get(op)
        if typ is None or op == protocol.HELLO:
            raise protocol.ProtocolError(f"unknown op {op}")
        access = self.ctx.access
        try:
            # What decoding allocates (up to 21 times the meta: Python objects) is the key's
            # before it is allocated; then what serving it allocates: its reply's bytes (an
            # inline GET's blocks) and its transfers' descriptor lists.
            n = protocol.decoded_bound(op, frame.meta.nbytes)
            why = self._charge(n)
            if why is not None:
                raise RequestError(f"decoding a request of up to {n} bytes refused: {why}")
            msg = frame.decode(typ)
            extra = (protocol.reply_bound(op, msg) - protocol.ERROR_REPLY_BOUND
                     + protocol.work_bound(msg))
            if extra > 0:
                why = self._charge(extra)
                if why is not None:
                    raise RequestError(f"a request holding up to {extra} bytes (its reply, its "
                                       f"transfers) refused: {why}")
            busy = access.begin(self.host)
            if busy is not None:
                self.ctx.count("rejected_busy")
                raise RequestError(busy)
            try:
                reply, payload = self._serve(op, msg, frame.payload)
            finally:
                access.end(self.host)
        except RequestError as e:
            self.ctx.count("bad_requests")
            self.ctx.warn(f"refused-{protocol.OP_NAMES[op]}", self.staged.owner,
                          "host %s (%s): %s request refused: %s", self.host, self.peer,
                          protocol.OP_NAMES[op], e)
            self._sent(ch.send(protocol.ERROR | protocol.REPLY, frame.req_id,
                               protocol.ErrorReply(str(e)[:protocol.MAX_ERROR_CHARS])))
            return
        self.ctx.count(protocol.OP_NAMES[op])
        self._sent(ch.send(op | protocol.REPLY, frame.req_id, reply, payload))

    def _serve(self, op: int, msg: protocol.Msg, data: memoryview
               ) -> tuple[protocol.Msg, list[memoryview]]:
        """One request's reply and payload. Raises RequestError."""
        store = self.ctx.store
        acks = self.ctx.acks
        if isinstance(msg, (protocol.Blocks, protocol.KeyList, protocol.Durable)):
            why = self.ctx.access.refused(self.host, msg.keys)
            if why is not None:
                raise RequestError(why)
        if isinstance(msg, protocol.Blocks):
            if op == protocol.PUT:
                flags = acks.put(msg.keys, lambda settle: self.blocks.put(msg, data, settle),
                                 self.staged.owner)
                self._describe([k for k, f in zip(msg.keys, flags) if f])
                return protocol.Flags(flags), []
            flags, payload, got = self.blocks.get(msg)
            return protocol.Flags(flags, got), payload
        if isinstance(msg, protocol.Durable):
            deadline = time.monotonic() + msg.budget_ms / 1000.0
            return protocol.Flags(acks.durable(msg.keys, deadline)), []
        if isinstance(msg, protocol.KeyList):
            if op == protocol.EXISTS:
                return protocol.Flags(self._durable_now(msg.keys)), []
            acks.deleted(msg.keys)
            self.ctx.feeds.forget(msg.keys)
            return protocol.Count(store.delete_many(msg.keys)), []
        if isinstance(msg, (protocol.Announce, protocol.FeedRead)):
            return self._feed(msg), []
        if isinstance(msg, protocol.RegisterNs):
            try:
                self.ctx.access.register(self.host, msg)
            except AccessError as e:
                raise RequestError(str(e)) from None
        elif isinstance(msg, protocol.Metadata):
            if self.ctx.mover is None:
                raise RequestError("this agent runs without NIXL (--transport tcp)")
            try:
                self.endpoint.load(msg.nixl_md)
            except Exception as e:  # noqa: BLE001
                raise RequestError(f"NIXL metadata unusable: {e}") from None
        elif isinstance(msg, protocol.Prove):
            self.endpoint.prove(msg)
        else:   # STATS
            return protocol.StatsReply(self._stats()), []
        return protocol.Empty(), []

    def _durable_now(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, held durably (the store first: a key it has is durable unless hidden)."""
        there = self.ctx.store.exists_many(keys)
        return [t and not h for t, h in zip(there, self.ctx.acks.hidden(keys))]

    def _feed(self, msg: protocol.Announce | protocol.FeedRead) -> protocol.Msg:
        """ANNOUNCE: record the pages of the host's namespaces whose block is durable here;
        FEED: a page of a namespace the host may use (`offload.agent.feed`)."""
        access, feeds = self.ctx.access, self.ctx.feeds
        if isinstance(msg, protocol.FeedRead):
            why = access.refused(self.host, [msg.ns])
            if why is not None:
                raise RequestError(why)
            pages, nxt, first = feeds.read(msg.ns, msg.after, msg.limit)
            return protocol.FeedPage(feeds.epoch, [(p.key, p.hash, p.parent) for p in pages],
                                     nxt, first)
        keys = [p[0] for p in msg.pages]
        why = access.refused(self.host, keys)
        if why is not None:
            raise RequestError(why)
        ok = self._durable_now(keys)
        kept = iter(feeds.announce(access.tenant(self.host),
                                   [Page(*p) for p, f in zip(msg.pages, ok) if f]))
        return protocol.Flags([f and next(kept) for f in ok])

    def _describe(self, keys: Sequence[bytes]) -> None:
        """Describe a namespace to the store once this connection stored a block of it (a
        namespace with no block never reaches the store's own records), in the background and
        bounded per host key (`offload.agent.describe`)."""
        for k in keys:
            digest = bytes(k[:NS_BYTES])
            if digest not in self._described:
                ns = self.ctx.access.namespace(self.host, digest)
                if ns is not None and self.ctx.describer.stored(self.staged.owner, ns):
                    self._described.add(digest)

    def _stats(self) -> dict[str, int | float | str]:
        s = self.ctx.store.stats()
        out: dict[str, int | float | str] = {}
        for f in dataclasses.fields(s):
            v = getattr(s, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f.name] = v if type(v) in (int, float) else (
                    int(v) if isinstance(v, int) else float(v))
        out.update({f"agent_{k}": v for k, v in self.ctx.counters().items()})
        out.update({f"agent_quota_{k}": v for k, v in self.ctx.access.usage().items()})
        out["agent_feed_pages"] = self.ctx.feeds.size()
        out["agent_feed_pages_key"] = self.ctx.feeds.held(self.staged.owner)
        out["agent_memory_held"] = self.ctx.memory.held()
        out["agent_memory_held_key"] = self.ctx.memory.held(self.staged.owner)
        if self.ctx.mover is not None:
            out["agent_nixl_peers"] = self.ctx.mover.peers()
            out["agent_quarantined_now"] = self.ctx.mover.quarantine.held()
            out["agent_quarantined_bytes_now"] = self.ctx.mover.quarantine.held_bytes()
            out["agent_metadata_crashes"] = self.ctx.mover.vetter.crashes
            out["agent_checker_seconds_key"] = self.ctx.mover.vetter.left(self.staged.owner)
        return out

