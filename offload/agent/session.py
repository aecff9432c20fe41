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
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Sequence

import msgspec

from offload.agent import protocol
from offload.agent.access import AccessError
from offload.agent.acks import GET_WAIT_S, Settle
from offload.agent.direct import direct_get, direct_put
from offload.agent.feed import Page
from offload.agent.rate import endpoint_of
from offload.agent.staged import StagedPath
from offload.agent.vet import HELD_PER_BYTE
from offload.keys import NS_BYTES

if TYPE_CHECKING:
    from offload.agent.context import AgentContext
    from offload.agent.mover import Mover

log = logging.getLogger("offload.agent")


class RequestError(Exception):
    """An authenticated request that cannot be served; answered with ERROR, connection kept."""


class Session:
    def __init__(self, ctx: "AgentContext", sock: socket.socket, peer: str, conn_id: int):
        self.ctx = ctx
        self.sock = sock
        self.peer = peer
        self.conn_id = conn_id
        self.host = "?"
        self.admitted = False
        self.nixl_peer: str | None = None      # loaded; used only once proven (`_peer`)
        self.ch: protocol.Channel | None = None
        self.proof_tag = os.urandom(protocol.PROOF_TAG_BYTES)
        self._challenge: tuple[str, bytes, bytes] | None = None    # (peer, nonce, metadata)
        self._described: set[bytes] = set()    # namespaces described to the store
        self.staged = StagedPath(ctx, conn_id)
        self._frame_bytes = 0                  # charged for the request being served and its
                                               # reply (ctx.memory), given back once it is sent
        self._md_bytes = 0                     # charged for the NIXL metadata it has loaded

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
        mover = self.ctx.mover
        if self.nixl_peer is not None and mover is not None:
            mover.drop_peer(self.nixl_peer, self.conn_id)
            self.nixl_peer = None
        self._release_md(0)
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
                self._load(hello.nixl_md)
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
            max_block=self.ctx.limits.max_block, nixl=nixl_ok, proof_tag=self.proof_tag)))

    def _sent(self, n: int) -> None:
        """A reply of `n` bytes was written: counted if more than its charge (the invariant:
        every byte held for a key is charged first; `tests/agent/test_memory_charge.py`)."""
        if n > self._frame_bytes:
            self.ctx.count("uncharged_bytes", n - self._frame_bytes)
            self.ctx.warn("uncharged", self.staged.owner, "host %s: a reply of %d bytes "
                          "exceeded its charge of %d", self.host, n, self._frame_bytes)

    def _load(self, md: bytes) -> None:
        """Load this connection's NIXL metadata and challenge its endpoint (unproven until the
        host echoes the nonce: PROVE). Raises on unusable metadata."""
        mover = self.ctx.mover
        assert mover is not None
        self._challenge = None
        why = self.ctx.challenges.take(self.staged.owner, endpoint_of(md))
        if why is not None:           # nothing loaded, nothing sent: the flood costs its sender
            self.ctx.count("rejected_challenges")
            raise RequestError(why)
        owner = self.staged.owner
        # What NIXL keeps of it, for this connection's life, is the key's before it is loaded.
        n = HELD_PER_BYTE * len(md)
        why = self.ctx.memory.take(owner, n)
        if why is not None:
            self.ctx.count("rejected_memory")
            raise RequestError(f"NIXL metadata of {len(md)} bytes refused: {why}")
        try:
            if self.nixl_peer is None:
                self.nixl_peer = mover.add_peer(md, self.conn_id, self.host, owner)
            else:
                self.nixl_peer = mover.update_peer(self.nixl_peer, md, self.conn_id, self.host,
                                                   owner)
        except BaseException:
            self.ctx.memory.give(owner, n)      # not loaded: the peer it had (if any) stays
            raise
        self._release_md(n)
        nonce, loaded = mover.challenge(self.nixl_peer, self.proof_tag)
        self._challenge = (self.nixl_peer, nonce, loaded)

    def _release_md(self, n: int) -> None:
        """The connection now holds `n` bytes of loaded metadata: what it held before goes back."""
        old, self._md_bytes = self._md_bytes, n
        if old:
            self.ctx.memory.give(self.staged.owner, old)

    def _prove(self, msg: protocol.Prove) -> None:
        """One try per challenge: the nonce sent to the endpoint must come back, and the MAC of it
        under this connection's key must be in the endpoint's memory where the host says."""
        c, self._challenge = self._challenge, None
        mover = self.ctx.mover
        j = next((j for j, n in enumerate(msg.nonces) if c is not None and
                  hmac.compare_digest(n, c[1])), None)
        mac = None
        if mover is not None and c is not None:
            self._quarantine_room(mover)        # its read-back may be quarantined too
        if c is not None and mover is not None and j is not None and self.ch is not None:
            mac = mover.read_back(c[0], msg.addr + j * protocol.PROOF_MAC_BYTES,
                                  protocol.PROOF_MAC_BYTES,
                                  time.monotonic() + self.ctx.limits.io_timeout, self.staged.owner)
        if c is None or mover is None or mac is None or self.ch is None \
                or not hmac.compare_digest(mac, self.ch.proof(c[1])) or not mover.prove(c[0], c[2]):
            self.ctx.count("proofs_failed")
            raise RequestError("the NIXL endpoint of this connection is not proven (no pending "
                               "challenge, a wrong nonce, its MAC not found in the endpoint's "
                               "memory, or newer metadata meanwhile)")
        self.ctx.count("proofs")
        self.ctx.say("proven", self.staged.owner, logging.INFO,
                     "host %s (%s): NIXL endpoint %s proven", self.host, self.peer, c[0])

    def _peer(self) -> str | None:
        """The connection's NIXL peer, if proven (its metadata unchanged since)."""
        mover = self.ctx.mover
        return self.nixl_peer if mover is not None and mover.proven(self.nixl_peer) else None

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
                flags = acks.put(msg.keys, lambda settle: self._put(msg, data, settle),
                                 self.staged.owner)
                self._describe([k for k, f in zip(msg.keys, flags) if f])
                return protocol.Flags(flags), []
            flags, payload, got = self._get(msg)
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
                self._load(msg.nixl_md)
            except Exception as e:  # noqa: BLE001
                raise RequestError(f"NIXL metadata unusable: {e}") from None
        elif isinstance(msg, protocol.Prove):
            self._prove(msg)
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

    def _check(self, req: protocol.Blocks) -> str | None:
        """Bounds of a PUT / GET; with descriptors, the connection's proven NIXL peer, whose
        registered memory they must lie in. Raises RequestError."""
        n = len(req.keys)
        if len(req.sizes) != n or (req.descs is not None and len(req.descs) != n):
            raise RequestError(f"{n} keys but {len(req.sizes)} sizes / "
                               f"{len(req.descs or [])} descriptor lists")
        for size in req.sizes:
            if size > self.ctx.limits.max_block:
                raise RequestError(f"block of {size} bytes exceeds the agent's limit "
                                   f"{self.ctx.limits.max_block}")
        if req.descs is not None:
            total = sum(len(d) for d in req.descs)
            if total > protocol.MAX_DESCS_PER_REQUEST:
                raise RequestError(f"{total} descriptors in one request; the limit is "
                                   f"{protocol.MAX_DESCS_PER_REQUEST}")
            for size, descs in zip(req.sizes, req.descs):
                if sum(d[1] for d in descs) != size:
                    raise RequestError("descriptor lengths do not add up to the block size")
            peer = self._peer()
            if peer is None:
                raise RequestError("descriptors sent but this connection does not use NIXL "
                                   "(no NIXL metadata, or its endpoint is not proven: PROVE)")
            assert self.ctx.mover is not None
            if not self.ctx.mover.covers(peer, [d for ds in req.descs for d in ds]):
                raise RequestError(f"descriptors outside the memory NIXL agent {peer} "
                                   "registered")
            self._quarantine_room(self.ctx.mover)
            return peer
        return None

    def _quarantine_room(self, mover: "Mover") -> None:
        """Refuse a NIXL request (PROVE too) while this host key's quarantine is full."""
        q, limit = mover.quarantine, self.ctx.limits.max_quarantine
        q.reap()
        held = q.held_bytes(self.staged.owner)
        if held >= limit:
            self.ctx.count("rejected_quarantine")
            raise RequestError(f"transfers of this host key that outlived their budget still "
                               f"hold {held} bytes in quarantine (--max-quarantine {limit}); "
                               "retry once NIXL reports them finished")

    def _put(self, req: protocol.Blocks, payload: memoryview, settle: Settle | None
             ) -> Sequence[bool | None]:
        """Per block, written (durable later for the disk store: `ctx.acks`), or None: received
        in staging, its store write reports to `settle` (`StagedPath.put`)."""
        peer = self._check(req)
        store = self.ctx.store
        if req.descs is None:
            if sum(req.sizes) != payload.nbytes:
                raise RequestError(f"payload of {payload.nbytes} bytes, sizes add up to "
                                   f"{sum(req.sizes)}")
            blocks, off = [], 0
            for size in req.sizes:
                blocks.append([payload[off:off + size]])
                off += size
            self.ctx.count("bytes_inline_in", payload.nbytes)
            return store.put_many(req.keys, blocks)
        assert peer is not None and self.ctx.mover is not None
        deadline = time.monotonic() + req.budget_ms / 1000.0
        present = store.exists_many(req.keys)
        ok: list[bool | None] = list(present)
        todo = [i for i, p in enumerate(present) if not p]
        q, owner = self.ctx.mover.quarantine, self.staged.owner
        allow = q.claim(owner, sum(req.sizes[i] for i in todo), self.ctx.limits.max_quarantine)
        try:
            todo = direct_put(self.ctx.direct(), peer, req, todo, ok, deadline, owner, allow)
        finally:
            q.unclaim(owner, allow)
        if not todo:
            return ok
        self.staged.put(req, todo, ok, peer, deadline, settle)
        return ok

    def _get(self, req: protocol.Blocks
             ) -> tuple[list[bool], list[memoryview], list[int] | None]:
        """A block put but not yet durable (`ctx.acks`) is waited for, briefly, then a miss."""
        acks = self.ctx.acks
        hidden = acks.hidden(req.keys)
        if any(hidden):
            end = time.monotonic() + min(GET_WAIT_S, req.budget_ms / 1000.0)
            acks.wait([k for k, h in zip(req.keys, hidden) if h], end)
            hidden = acks.hidden(req.keys)
        if not any(hidden):
            return self._get_visible(req)
        idx = [i for i, h in enumerate(hidden) if not h]
        sub = msgspec.structs.replace(
            req, keys=[req.keys[i] for i in idx], sizes=[req.sizes[i] for i in idx],
            descs=None if req.descs is None else [req.descs[i] for i in idx])
        got, payload, sub_sums = self._get_visible(sub)
        flags = [False] * len(req.keys)
        out_sums = None if sub_sums is None else [0] * len(req.keys)
        for n, (i, f) in enumerate(zip(idx, got)):
            flags[i] = f
            if out_sums is not None and sub_sums is not None:
                out_sums[i] = sub_sums[n]
        return flags, payload, out_sums

    def _get_visible(self, req: protocol.Blocks
                     ) -> tuple[list[bool], list[memoryview], list[int] | None]:
        """(flags, inline payload, with descriptors each block's checksum for the host)."""
        peer = self._check(req)
        store = self.ctx.store
        if req.descs is None:
            total = sum(req.sizes)
            if total + 4096 > self.ctx.limits.max_body:
                raise RequestError(f"reply of {total} bytes would exceed the frame limit")
            buf = memoryview(bytearray(total))
            dests, off = [], 0
            for size in req.sizes:
                dests.append([buf[off:off + size]])
                off += size
            flags = store.get_many(req.keys, dests)
            out = [d[0] for d, f in zip(dests, flags) if f]
            self.ctx.count("bytes_inline_out", sum(v.nbytes for v in out))
            return flags, out, None
        assert peer is not None and self.ctx.mover is not None
        deadline = time.monotonic() + req.budget_ms / 1000.0
        ok = [False] * len(req.keys)
        got = [0] * len(req.keys)
        q, owner = self.ctx.mover.quarantine, self.staged.owner
        allow = q.claim(owner, sum(req.sizes), self.ctx.limits.max_quarantine)
        try:
            rest = direct_get(self.ctx.direct(), peer, req, ok, deadline, owner, allow, got)
        finally:
            q.unclaim(owner, allow)
        if rest:
            self.staged.get(req, rest, ok, peer, deadline, got)
        return ok, [], got
