"""Namespace descriptions the agent gives its store: off the data path, bounded per host key.

A namespace's description (model, dtype, layout, ...: what `cache stats` shows for a digest)
reaches the store's own records (`BlockStore.register_namespace`; the disk store writes it to its
index in a synced transaction, which may wait on the index for seconds). Before, each connection
described each namespace it stored a block of, inline in its first PUT (which could wait up to
60 s on that transaction, against the data path's 0.5 s promise), and nothing bounded the
records: one key under `--max-namespaces 1024` left 4,000 rows (5.4 MiB) with no block.

Primitives: `Describer(store, per_key, queue=QUEUE)`; `.stored(owner, ns)` after a block of `ns`
was stored for tenant `owner`: queued for the describing thread, once per (owner, digest);
`.close()`. Bounded: at most `per_key` digests described per tenant over the agent's life (its
`--max-namespaces`; more are not described, counted `namespaces_undescribed`: their blocks are
stored and served the same, `cache stats` shows their digest only), at most `queue` waiting
(more are dropped and offered again by the next PUT). The store's rows of namespaces whose
blocks are all gone are the store's to prune. Never raises.
"""

from __future__ import annotations

import logging
import queue as _queue
import threading
from typing import Callable

from offload.keys import Namespace
from offload.store.base import BlockStore

log = logging.getLogger("offload.agent")
QUEUE = 1024


class Describer:
    def __init__(self, store: BlockStore, per_key: int, count: Callable[[str, int], None],
                 queue: int = QUEUE):
        self._store = store
        self._per_key = per_key
        self._count = count
        self._lock = threading.Lock()
        self._done: dict[str, set[bytes]] = {}       # tenant -> digests described (or queued)
        self._q: _queue.Queue[Namespace | None] = _queue.Queue(queue)
        self._thread: threading.Thread | None = None

    def stored(self, owner: str, ns: Namespace) -> bool:
        """A block of `ns` was stored for `owner`: describe it once (in the background). False
        if it will not be (this tenant's bound reached, or the queue full: offer it again)."""
        digest = ns.digest()
        with self._lock:
            done = self._done.setdefault(owner, set())
            if digest in done:
                return True
            if len(done) >= self._per_key:
                self._count("namespaces_undescribed", 1)
                return False
            try:
                self._q.put_nowait(ns)
            except _queue.Full:
                return False
            done.add(digest)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="agent-describe",
                                                daemon=True)
                self._thread.start()
        return True

    def _run(self) -> None:
        while (ns := self._q.get()) is not None:
            try:
                self._store.register_namespace(ns)
            except Exception as e:  # noqa: BLE001 - a description is not worth a thread
                log.warning("describing namespace %s to the store failed: %s",
                            ns.digest().hex()[:16], e)

    def close(self) -> None:
        try:
            self._q.put_nowait(None)
        except _queue.Full:
            pass
