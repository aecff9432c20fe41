"""A KV-event subscriber: SGLang's ZMQ stream decoded with SGLang's own classes, and what a
router would score from it.

- `Subscriber(endpoint, replay_endpoint, topic)`: a SUB socket on the server's publisher (and a
  DEALER on its replay ROUTER). `replay(from_seq)` asks for the batches the publisher still
  buffers; `poll(timeout_s)` reads live batches. Both return (seq, `KVEventBatch`) pairs.
- `Residency`: per medium (`GPU`, `CPU_PINNED`, `DISK`, `EXTERNAL`), the block hashes a server
  announced and has not removed; `apply(batch)`; `prefix_pages(hashes, medium)`: the leading
  pages of a prompt held there.
- `prompt_hashes(token_ids, page_size)`: the block hashes of a prompt's full pages (SGLang's
  `get_hash_str` chain, `hash_str_to_int64`), for a request without LoRA or cache salt.

pyzmq and msgspec come with SGLang; imported on first use.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Sequence

from offload.events.chain import event_hash

MEDIA = ("GPU", "CPU_PINNED", "DISK", "EXTERNAL")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _decoder() -> Any:
    import msgspec
    from sglang.srt.disaggregation.kv_events import KVEventBatch

    return msgspec.msgpack.Decoder(type=KVEventBatch)


class Subscriber:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = ""):
        import zmq

        self._zmq = zmq
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.decode = _decoder().decode
        self.last_seq = -1

    def _batch(self, seq_bytes: bytes, payload: bytes) -> tuple[int, Any]:
        seq = int.from_bytes(seq_bytes, "big")
        self.last_seq = max(self.last_seq, seq)
        return seq, self.decode(payload)

    def replay(self, from_seq: int = 0, timeout_s: float = 10.0) -> list[tuple[int, Any]]:
        """The batches from `from_seq` on that the publisher still holds (empty without a
        replay endpoint). Raises TimeoutError when the publisher does not answer."""
        if self.replay_endpoint is None:
            return []
        zmq = self._zmq
        req = self.ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.replay_endpoint)
        try:
            req.send_multipart((b"", from_seq.to_bytes(8, "big")))
            out: list[tuple[int, Any]] = []
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not req.poll(int(left * 1000)):
                    raise TimeoutError(f"no replay answer from {self.replay_endpoint} in "
                                       f"{timeout_s:g} s")
                frames = req.recv_multipart()
                _empty, _topic, seq_bytes, payload = frames[-4:]
                if seq_bytes == END_SEQ:
                    return out
                out.append(self._batch(seq_bytes, payload))
        finally:
            req.close()

    def poll(self, timeout_s: float) -> list[tuple[int, Any]]:
        out: list[tuple[int, Any]] = []
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sub.poll(int(left * 1000)):
                return out
            _topic, seq_bytes, payload = self.sub.recv_multipart()
            out.append(self._batch(seq_bytes, payload))

    def close(self) -> None:
        self.sub.close(linger=0)


class Residency:
    """What one server's events say each tier holds."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = defaultdict(set)
        self.seen: set[int] = set()     # batch sequence numbers applied (replay overlaps live)

    def apply(self, seq: int, batch: Any) -> None:
        from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        if seq in self.seen:
            return
        self.seen.add(seq)
        for ev in batch.events:
            medium = str(getattr(ev, "medium", None) or "GPU")
            if isinstance(ev, BlockStored):
                self.held[medium].update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.held[medium].difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):   # the radix tree's reset: L1 and L2
                self.held["GPU"].clear()
                self.held["CPU_PINNED"].clear()

    def prefix_pages(self, hashes: Sequence[int], medium: str) -> int:
        held = self.held.get(medium, set())
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n


def prompt_hashes(token_ids: Sequence[int], page_size: int) -> list[int]:
    """SGLang's block hashes of the full pages of `token_ids` (no LoRA, no cache salt)."""
    full = len(token_ids) // page_size * page_size
    if full == 0:
        return []
    from sglang.srt.mem_cache.utils import get_hash_str

    return [event_hash(h) for h in get_hash_str(list(token_ids[:full]), None, page_size=page_size)]
