"""One control connection of an `AgentStore` to the agent (the client side of the protocol).

Primitives: `ConnSettings` (address, secret, host name, transport, timeout) and `ConnHooks` (what
the connection asks of its store: is the agent marked down, mark it down, this host's NIXL
metadata, its namespaces, the proof nonces its NIXL agent received, registered memory to put
their MACs in), both handed in by the store;
`AgentConn(settings, hooks)`; `.lock` serialises its use; `.connect()` opens the connection
(handshake, HELLO with this host's NIXL metadata — sent as METADATA after the HELLO when larger
than the agent's pre-authentication limit — then PROVE: the nonce the agent sent to this host's
NIXL endpoint, echoed, with the address where its MAC under this connection's key lies for the
agent to read back; namespaces re-sent) unless open; `.request(op, msg, payload, deadline)`
sends one frame and returns the decoded reply and its payload. Everything a call does, opening
the connection included, runs under the one `deadline` its caller gives (`AgentStore._use`:
`timeout_s` for the whole call), never one timeout per step; `.drop()`. Any failure marks the
agent down (`hooks.mark_down`) and raises `Down`; an ERROR reply raises `Refused` and keeps the
connection. Closing a connection does not withdraw a request: frames the agent has not read
yet are still read and served (a reset, SO_LINGER 0, does not discard them either: measured on
loopback, Linux 6.18), which is why a GET never names the caller's pages (`AgentStore`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, ContextManager

from offload.agent import protocol
from offload.agent.access import register_msg
from offload.keys import Namespace

log = logging.getLogger("offload.agent.client")
HELLO_MD_LIMIT = protocol.PRE_AUTH_MAX_BODY - 4096   # larger NIXL metadata goes in a METADATA


REPROVE_FIRST_S = 1.0      # a connection left inline by a missing proof notification proves again
REPROVE_MAX_S = 300.0      # after this long at most (doubling from REPROVE_FIRST_S)


class Down(Exception):
    """The agent cannot be used right now (the call is a miss)."""


class Refused(Down):
    """The agent answered ERROR to one request; the connection stays usable."""


@dataclass(frozen=True)
class ConnSettings:
    address: tuple[str, int]
    secret: bytes
    host_name: str
    transport: str
    timeout_s: float


@dataclass(frozen=True)
class ConnHooks:
    is_down: Callable[[], bool]
    mark_down: Callable[[BaseException], None]
    nixl_metadata: Callable[[], bytes | None]
    namespaces: Callable[[], list[Namespace]]
    proof_nonces: Callable[[bytes, float], list[bytes]]
    proof_area: Callable[[list[bytes]], ContextManager[int | None]]


class AgentConn:
    def __init__(self, settings: ConnSettings, hooks: ConnHooks):
        self.settings = settings
        self.hooks = hooks
        self.lock = threading.Lock()
        self.ch: protocol.Channel | None = None
        self.info: protocol.HelloReply | None = None
        self.nixl = False                 # the agent moves this connection's bytes by NIXL
        self._reprove_at: float | None = None   # when to reconnect to prove NIXL again
        self._reprove_gap = REPROVE_FIRST_S
        self._req_id = 0

    def connect(self, deadline: float | None = None) -> protocol.HelloReply:
        """Open the connection if needed (lock held), every step by `deadline` (default:
        `timeout_s` from now); returns the agent's limits."""
        s, h = self.settings, self.hooks
        if self.ch is not None and self.info is not None:
            if self.nixl or self._reprove_at is None or time.monotonic() < self._reprove_at:
                return self.info
            self.drop()                   # inline since a proof found no notification: prove again
        if h.is_down():
            raise Down("agent marked down")
        if deadline is None:
            deadline = time.monotonic() + s.timeout_s
        try:
            sock = socket.create_connection(s.address, timeout=_left(deadline))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.ch = protocol.handshake_client(sock, s.secret, _left(deadline))
            self.ch.io_timeout = s.timeout_s
            md = h.nixl_metadata()
            small = md is not None and len(md) <= HELLO_MD_LIMIT
            info = self._send(protocol.HELLO, protocol.Hello(
                host=s.host_name, transport=s.transport, nixl_md=md if small else None),
                deadline=deadline)[0]
            assert isinstance(info, protocol.HelloReply)
            self.ch.max_body = info.max_body
            self.nixl = info.nixl and small
            if md is not None and not small:
                try:
                    self._send(protocol.METADATA, protocol.Metadata(md), deadline=deadline)
                    self.nixl = True
                except Refused:
                    self.nixl = False
            if self.nixl:
                self.nixl = self._prove(info.proof_tag, deadline)
            if md is not None and not self.nixl:
                log.warning("agent %s:%d does not move bytes by NIXL; they travel on the "
                            "control connection", *s.address)
            for ns in h.namespaces():
                try:
                    self._send(protocol.REGISTER_NS, register_msg(ns), deadline=deadline)
                except Refused:
                    pass             # logged; its keys will be refused too
            self.info = info
            log.info("connected to agent %s at %s:%d", info.agent, *s.address)
            return info
        except Down:
            self.drop()
            raise
        except (OSError, protocol.ProtocolError, EOFError) as e:
            self.fail(e)
            raise Down(str(e)) from None

    def _prove(self, tag: bytes, deadline: float) -> bool:
        """Echo the nonce the agent sent to this host's NIXL endpoint; True once accepted."""
        now = time.monotonic()
        # Half of what is left of the call: a connection without NIXL still opens in this call.
        nonces = self.hooks.proof_nonces(tag, now + max(0.0, deadline - now) / 2)
        if not nonces:
            # No notification yet (the agent's first check of our metadata may be slow, or its
            # notifications cannot reach this host): bytes travel on the control connection, and
            # a later call connects again to prove (after 1 s, then twice as long each time).
            self._reprove_at = time.monotonic() + self._reprove_gap
            self._reprove_gap = min(self._reprove_gap * 2, REPROVE_MAX_S)
            log.warning("agent %s:%d: no proof notification arrived by NIXL; bytes travel on "
                        "the control connection (proving again in %.0f s)",
                        *self.settings.address, self._reprove_at - time.monotonic())
            return False
        self._reprove_at, self._reprove_gap = None, REPROVE_FIRST_S
        nonces = nonces[-protocol.MAX_PROOF_NONCES:]
        assert self.ch is not None
        with self.hooks.proof_area([self.ch.proof(n) for n in nonces]) as addr:
            if addr is None:
                log.warning("agent %s:%d: no proof slot free; bytes travel on the control "
                            "connection", *self.settings.address)
                return False
            try:
                self._send(protocol.PROVE, protocol.Prove(nonces, addr), deadline=deadline)
                return True
            except Refused:
                return False

    def request(self, op: int, msg: protocol.Msg, payload: list[memoryview] | None = None,
                deadline: float | None = None) -> tuple[protocol.Msg, memoryview]:
        """One request and its reply (lock held), opening the connection first if needed, all
        by `deadline` (default: `timeout_s` from now). Raises Down / Refused."""
        if deadline is None:
            deadline = time.monotonic() + self.settings.timeout_s
        self.connect(deadline)
        return self._send(op, msg, payload, deadline)

    def _send(self, op: int, msg: protocol.Msg, payload: list[memoryview] | None = None,
              deadline: float | None = None) -> tuple[protocol.Msg, memoryview]:
        ch = self.ch
        if ch is None:
            raise Down("not connected")
        if deadline is None:
            deadline = time.monotonic() + self.settings.timeout_s
        if deadline <= time.monotonic():
            raise Down("the call's deadline passed")     # nothing sent: the connection stays
        self._req_id += 1
        try:
            ch.send(op, self._req_id, msg, payload, deadline=deadline)
            frame = ch.recv(deadline=deadline)
            if frame.req_id != self._req_id:
                raise protocol.ProtocolError(f"reply to request {frame.req_id}, expected {self._req_id}")
            if frame.op == protocol.ERROR | protocol.REPLY:
                err = frame.decode(protocol.ErrorReply)
                log.warning("agent refused %s: %s", protocol.OP_NAMES.get(op, op), err.message)
                raise Refused(err.message)
            if frame.op != op | protocol.REPLY:
                raise protocol.ProtocolError(f"reply op {frame.op} to op {op}")
            return frame.decode(protocol.REPLY_TYPES[op]), frame.payload
        except Down:
            raise
        except (OSError, protocol.ProtocolError, EOFError) as e:
            self.fail(e)
            raise Down(str(e)) from None

    def drop(self) -> None:
        if self.ch is not None:
            try:
                self.ch.sock.close()
            except OSError:
                pass
        self.ch = None
        self.info = None
        self.nixl = False

    def fail(self, e: BaseException) -> None:
        self.drop()
        self.hooks.mark_down(e)


def _left(deadline: float) -> float:
    """Seconds left until `deadline`; TimeoutError (a Down) once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the call's deadline passed")
    return left
