"""The NIXL endpoint of one connection on the agent: loaded, challenged, proven, dropped.

Primitives: `Endpoint(session)`, a part of its `Session` (reads its context, host, channel and
host key); `load(md)` charges what NIXL keeps of the metadata to the host key
(`vet.HELD_PER_BYTE` a byte, before it is loaded: the one place), loads it (a checker child
first, `vet`) and sends the endpoint a fresh nonce, the challenge, after the host key's challenge
buckets granted one (`rate.Challenges.take`); `prove(msg)` accepts the endpoint only if that
nonce comes back and its MAC under the connection's key is read back from the endpoint's memory
(one try per challenge); `peer()` is the endpoint once proven (unchanged since);
`quarantine_room()` refuses a NIXL request, PROVE included, while the host key's quarantined
transfers hold `--max-quarantine`; `drop()` releases the endpoint and its charge (at close).
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from typing import TYPE_CHECKING

from offload.agent import protocol
from offload.agent.rate import endpoint_of
from offload.agent.refused import RequestError
from offload.agent.vet import HELD_PER_BYTE

if TYPE_CHECKING:
    from offload.agent.mover import Mover
    from offload.agent.session import Session


class Endpoint:
    def __init__(self, session: "Session"):
        self._s = session
        self.nixl_peer: str | None = None      # loaded; used only once proven (`peer`)
        self.proof_tag = os.urandom(protocol.PROOF_TAG_BYTES)
        self._challenge: tuple[str, bytes, bytes] | None = None    # (peer, nonce, metadata)
        self._md_bytes = 0                     # charged for the NIXL metadata it has loaded

    def load(self, md: bytes) -> None:
        """Load this connection's NIXL metadata and challenge its endpoint (unproven until the
        host echoes the nonce: PROVE). Raises on unusable metadata."""
        s = self._s
        mover = s.ctx.mover
        assert mover is not None
        self._challenge = None
        why = s.ctx.challenges.take(s.staged.owner, endpoint_of(md))
        if why is not None:           # nothing loaded, nothing sent: the flood costs its sender
            s.ctx.count("rejected_challenges")
            raise RequestError(why)
        owner = s.staged.owner
        # What NIXL keeps of it, for this connection's life, is the key's before it is loaded.
        n = HELD_PER_BYTE * len(md)
        why = s.ctx.memory.take(owner, n)
        if why is not None:
            s.ctx.count("rejected_memory")
            raise RequestError(f"NIXL metadata of {len(md)} bytes refused: {why}")
        try:
            if self.nixl_peer is None:
                self.nixl_peer = mover.add_peer(md, s.conn_id, s.host, owner)
            else:
                self.nixl_peer = mover.update_peer(self.nixl_peer, md, s.conn_id, s.host, owner)
        except BaseException:
            s.ctx.memory.give(owner, n)      # not loaded: the peer it had (if any) stays
            raise
        self._release_md(n)
        nonce, loaded = mover.challenge(self.nixl_peer, self.proof_tag)
        self._challenge = (self.nixl_peer, nonce, loaded)

    def _release_md(self, n: int) -> None:
        """The connection now holds `n` bytes of loaded metadata: what it held before goes back."""
        old, self._md_bytes = self._md_bytes, n
        if old:
            self._s.ctx.memory.give(self._s.staged.owner, old)

    def drop(self) -> None:
        """The connection closes: its NIXL peer released, its metadata's charge given back."""
        mover = self._s.ctx.mover
        if self.nixl_peer is not None and mover is not None:
            mover.drop_peer(self.nixl_peer, self._s.conn_id)
            self.nixl_peer = None
        self._release_md(0)

    def prove(self, msg: protocol.Prove) -> None:
        """One try per challenge: the nonce sent to the endpoint must come back, and the MAC of it
        under this connection's key must be in the endpoint's memory where the host says."""
        s = self._s
        c, self._challenge = self._challenge, None
        mover = s.ctx.mover
        j = next((j for j, n in enumerate(msg.nonces) if c is not None and
                  hmac.compare_digest(n, c[1])), None)
        mac = None
        if mover is not None and c is not None:
            self.quarantine_room(mover)        # its read-back may be quarantined too
        if c is not None and mover is not None and j is not None and s.ch is not None:
            mac = mover.read_back(c[0], msg.addr + j * protocol.PROOF_MAC_BYTES,
                                  protocol.PROOF_MAC_BYTES,
                                  time.monotonic() + s.ctx.limits.io_timeout, s.staged.owner)
        if c is None or mover is None or mac is None or s.ch is None \
                or not hmac.compare_digest(mac, s.ch.proof(c[1])) or not mover.prove(c[0], c[2]):
            s.ctx.count("proofs_failed")
            raise RequestError("the NIXL endpoint of this connection is not proven (no pending "
                               "challenge, a wrong nonce, its MAC not found in the endpoint's "
                               "memory, or newer metadata meanwhile)")
        s.ctx.count("proofs")
        s.ctx.say("proven", s.staged.owner, logging.INFO,
                  "host %s (%s): NIXL endpoint %s proven", s.host, s.peer, c[0])

    def peer(self) -> str | None:
        """The connection's NIXL peer, if proven (its metadata unchanged since)."""
        mover = self._s.ctx.mover
        return self.nixl_peer if mover is not None and mover.proven(self.nixl_peer) else None

    def quarantine_room(self, mover: "Mover") -> None:
        """Refuse a NIXL request (PROVE too) while this host key's quarantine is full."""
        s = self._s
        q, limit = mover.quarantine, s.ctx.limits.max_quarantine
        q.reap()
        held = q.held_bytes(s.staged.owner)
        if held >= limit:
            s.ctx.count("rejected_quarantine")
            raise RequestError(f"transfers of this host key that outlived their budget still "
                               f"hold {held} bytes in quarantine (--max-quarantine {limit}); "
                               "retry once NIXL reports them finished")
