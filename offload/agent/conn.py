"""One control connection of an `AgentStore` to the agent (the client side of the protocol).

Primitives: `AgentConn(store)`; `.lock` serialises its use; `.connect()` opens the connection
(handshake, HELLO with this host's NIXL metadata, namespaces re-sent) unless open; `.request(op,
msg, payload)` sends one frame and returns the decoded reply and its payload; `.drop()`. Any
failure marks the agent down for `reconnect_s` (shared by all connections of the store) and raises
`Down`; an ERROR reply raises `Refused` and keeps the connection.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from typing import TYPE_CHECKING

from offload.agent import protocol

if TYPE_CHECKING:
    from offload.agent.client import AgentStore

log = logging.getLogger("offload.agent.client")


class Down(Exception):
    """The agent cannot be used right now (the call is a miss)."""


class Refused(Down):
    """The agent answered ERROR to one request; the connection stays usable."""


class AgentConn:
    def __init__(self, store: "AgentStore"):
        self.store = store
        self.lock = threading.Lock()
        self.ch: protocol.Channel | None = None
        self.info: protocol.HelloReply | None = None
        self._req_id = 0

    def connect(self) -> protocol.HelloReply:
        """Open the connection if needed (lock held); returns the agent's limits."""
        s = self.store
        if self.ch is not None and self.info is not None:
            return self.info
        if time.monotonic() < s.down_until:
            raise Down("agent marked down")
        try:
            sock = socket.create_connection(s.address, timeout=s.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.ch = protocol.handshake_client(sock, s.secret, s.timeout_s)
            md = s.nixl_metadata()
            info = self._send(protocol.HELLO, protocol.Hello(host=s.host_name, transport=s.transport,
                                               nixl_md=md))[0]
            assert isinstance(info, protocol.HelloReply)
            self.ch.max_body = info.max_body
            if md is not None and not info.nixl:
                log.warning("agent %s:%d does not move bytes by NIXL; they travel on the "
                            "control connection", *s.address)
            for ns in s.namespaces():
                self._send(protocol.REGISTER_NS, protocol.NamespaceMsg(dataclasses.asdict(ns)))
            self.info = info
            log.info("connected to agent %s at %s:%d", info.agent, *s.address)
            return info
        except Down:
            self.drop()
            raise
        except (OSError, protocol.ProtocolError, EOFError) as e:
            self.fail(e)
            raise Down(str(e)) from None

    def request(self, op: int, msg: protocol.Msg, payload: list[memoryview] | None = None
                ) -> tuple[protocol.Msg, memoryview]:
        """One request and its reply (lock held). Raises Down / Refused."""
        self.connect()
        return self._send(op, msg, payload)

    def _send(self, op: int, msg: protocol.Msg, payload: list[memoryview] | None = None
              ) -> tuple[protocol.Msg, memoryview]:
        ch = self.ch
        if ch is None:
            raise Down("not connected")
        self._req_id += 1
        try:
            ch.send(op, self._req_id, msg, payload)
            frame = ch.recv(idle_timeout=self.store.timeout_s)
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

    def fail(self, e: BaseException) -> None:
        self.drop()
        self.store.mark_down(e)
