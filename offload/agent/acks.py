"""PUTs the agent acknowledged before its store made them durable: hidden until the store did.

The disk store's `put_many` returns once a block's bytes are written; its group committer makes
the block durable and visible later (`offload.store.disk.commit`), and a sync or commit failure then
loses it, counted. The agent acknowledges a PUT when `put_many` returns, or through staging
once the blocks are in its staging memory with their write running (`offload.agent.staged`) —
the local store's promise: "stored unless its write or commit fails; invisible until durable" —
and keeps the keys of such puts here until the store says they are durable. Meanwhile EXISTS
reports them absent to every connection, a GET waits for them (at most `GET_WAIT_S`, then
misses) and DURABLE waits for them and reports per key. A crash loses only what was not
durable, which nobody was shown.

Primitives: `Acks(store, count)`; `.active` (the store commits in the background, i.e. has
`durable(keys)`; otherwise a put is durable once acknowledged and every call here passes
through); `put(keys, write)` (runs the put's store calls with its keys hidden; keys put True go
to the confirming thread, which waits for the store's commit with `store.durable` and releases
them, counting those lost in `put_lost`); `hidden(keys)`; `wait(keys, deadline)`;
`durable(keys, deadline)` (DURABLE: per key, durable now); `settle(keys, ok)` (a write still
running at the acknowledgement finished); `deleted(keys)` (a DELETE named hidden keys: deleted
again once durable, not counted lost if never); `close()`. Bounded: with `max_hidden` keys
hidden in all, or `max_hidden_per_key` of the put's `owner` (its tenant), a put waits for its
own commit before it is acknowledged, so a stalled committer cannot grow the table, and one
tenant's backlog makes only its own puts wait.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Callable, Sequence

from offload.store.base import BlockStore, CommitsNow, Durable, durable

log = logging.getLogger("offload.agent")

MAX_HIDDEN = 1 << 18      # keys acknowledged, not yet known durable (then puts wait for theirs)
MAX_HIDDEN_PER_KEY = 1 << 16   # ... of them of one host key (tenant): its backlog, not everyone's
GET_WAIT_S = 1.0          # a GET of a hidden key waits this long for its commit (as the store's)
RETRY_S = 0.05            # pause before asking again about keys still in flight
Settle = Callable[[Sequence[bytes], Sequence[bool]], None]


class Acks:
    def __init__(self, store: BlockStore, count: Callable[[str, int], None],
                 max_hidden: int = MAX_HIDDEN, max_hidden_per_key: int = MAX_HIDDEN_PER_KEY):
        self.store = store
        self.active = isinstance(store, Durable)
        self._count = count
        self._max = max_hidden
        self._max_owned = max_hidden_per_key
        self._owner: dict[bytes, str] = {}       # hidden key -> the tenant whose put hid it
        self._owned: Counter[str] = Counter()    # tenant -> its keys hidden
        self._cond = threading.Condition()
        self._hidden: dict[bytes, int] = {}      # key -> puts of it not yet known durable
        self._queue: dict[bytes, int] = {}       # acknowledged, to confirm -> puts
        self._deleted: set[bytes] = set()        # hidden keys a DELETE named
        self._thread: threading.Thread | None = None
        self._closed = False

    # ---------------------------------------------------------------- puts
    def put(self, keys: Sequence[bytes],
            write: Callable[[Settle | None], Sequence[bool | None]], owner: str = "") -> list[bool]:
        """`write(settle)` (the put's store calls) with `keys` hidden; its flags, acknowledged
        now. A block `write` flags None was received but its store write is still running: it
        reports to `settle` when done (with None for `settle`, `write` must finish every write
        first). A key put True stays hidden until the store made it durable (or lost it)."""
        if not self.active:
            return [bool(f) for f in write(None)]
        keys = [bytes(k) for k in keys]
        with self._cond:
            early = (len(self._hidden) < self._max and self._owned[owner] < self._max_owned
                     and not self._closed)
            for k in keys:
                if k not in self._hidden:
                    self._owner[k] = owner
                    self._owned[owner] += 1
                self._hidden[k] = self._hidden.get(k, 0) + 1
        flags: Sequence[bool | None] = [False] * len(keys)
        try:
            flags = write(self.settle if early else None)
            if not early:      # full: this put waits for its own commit (never counted as lost)
                flags = list(durable(self.store, keys, [bool(f) for f in flags]))
        finally:
            if early:
                now = [(k, f) for k, f in zip(keys, flags) if f is not None]
                self._settle([k for k, _ in now], [bool(f) for _, f in now], acked=False)
            else:
                self._release(Counter(keys))
        return [f is None or bool(f) for f in flags]

    def settle(self, keys: Sequence[bytes], ok: Sequence[bool]) -> None:
        """The store writes of acknowledged blocks finished: those written go to be confirmed,
        the others are released, counted as lost (`put_lost`: their put was acknowledged)."""
        self._settle(keys, ok, acked=True)

    def _settle(self, keys: Sequence[bytes], ok: Sequence[bool], acked: bool) -> None:
        now: Counter[bytes] = Counter()
        with self._cond:
            for k, f in zip(keys, ok):
                if f:
                    self._queue[k] = self._queue.get(k, 0) + 1
                else:
                    now[k] += 1
            if len(now) < len(keys) and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="agent-acks", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        if now:
            if acked:
                self._lost(sum(now.values()), "its store write failed")
            self._release(now)

    def _lost(self, n: int, why: str) -> None:
        self._count("put_lost", n)
        log.error("%d acknowledged blocks never became durable (%s): they are not stored", n, why)

    def _release(self, counts: "dict[bytes, int] | Counter[bytes]") -> None:
        with self._cond:
            for k, n in counts.items():
                left = self._hidden.get(k, 0) - n
                if left > 0:
                    self._hidden[k] = left
                else:
                    if self._hidden.pop(k, None) is not None:
                        who = self._owner.pop(k, "")
                        self._owned[who] -= 1
                        if self._owned[who] <= 0:
                            del self._owned[who]
                    self._deleted.discard(k)
            self._cond.notify_all()

    def _run(self) -> None:
        """Confirm acknowledged puts until closed (and nothing is left to confirm)."""
        while (batch := self._next()) is not None:
            if self._confirm(batch):
                time.sleep(RETRY_S)     # in flight past the store's own wait: ask again, no spin

    def _next(self) -> dict[bytes, int] | None:
        """Every key queued so far (waiting for one); None once closed with none left."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._queue) or self._closed)
            batch, self._queue = self._queue, {}
        return batch or None

    def _confirm(self, batch: dict[bytes, int]) -> bool:
        """Release the durable keys of `batch`, count the lost, queue again the ones the store
        still has in flight (True if any)."""
        keys = list(batch)
        try:
            # no hurry: the store's rounds stay grouped (a GET or DURABLE that waits kicks one)
            flags = list(self.store.durable(keys, hurry=False))    # type: ignore[attr-defined]
            rest = [k for k, f in zip(keys, flags) if not f]
            flying = self.store.exists_many(rest) if rest else []
        except Exception:  # noqa: BLE001 - the store never raises; be sure of it
            log.exception("confirming %d acknowledged blocks failed", len(keys))
            flags, rest, flying = [False] * len(keys), keys, [False] * len(keys)
        again = {k: batch[k] for k, f in zip(rest, flying) if f}   # still in flight
        with self._cond:
            lost = [k for k, f in zip(rest, flying) if not f and k not in self._deleted]
            if not self._closed:
                for k, n in again.items():
                    self._queue[k] = self._queue.get(k, 0) + n
            redo = [k for k, f in zip(keys, flags) if f and k in self._deleted]
            self._deleted.difference_update(redo)
        if redo:      # a DELETE named them while they were on their way: honoured now
            self.store.delete_many(redo)
        if lost:
            self._lost(sum(batch[k] for k in lost), "sync or commit failed")
        self._release({k: n for k, n in batch.items() if k not in again})
        return bool(again)

    # ---------------------------------------------------------------- queries
    def hidden(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether a put of it was acknowledged and is not known durable yet. Ask after
        the store (a key the store says exists is durable unless hidden here)."""
        if not self.active:
            return [False] * len(keys)
        with self._cond:
            return [bytes(k) in self._hidden for k in keys]

    def wait(self, keys: Sequence[bytes], deadline: float) -> bool:
        """Wait until none of `keys` is hidden or `deadline` (monotonic) passed; True if none is."""
        if not self.active:
            return True
        ks = [bytes(k) for k in keys]
        with self._cond:
            hurry = any(k in self._hidden for k in ks)
        if hurry and isinstance(self.store, CommitsNow):   # the confirmer lets rounds group; this
            self.store.commit_now()                        # waiter not
        with self._cond:
            while any(k in self._hidden for k in ks):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def durable(self, keys: Sequence[bytes], deadline: float) -> list[bool]:
        """DURABLE: per key, whether it is stored durably, once its puts acknowledged so far are
        confirmed (waiting until `deadline`; a key still hidden then is False)."""
        if not self.active:
            return self.store.exists_many(keys)
        self.wait(keys, deadline)
        out = [not h for h in self.hidden(keys)]
        idx = [i for i, f in enumerate(out) if f]
        if idx:
            for i, f in zip(idx, durable(self.store, [keys[i] for i in idx], [True] * len(idx))):
                out[i] = f
        return out

    def deleted(self, keys: Sequence[bytes]) -> None:
        """A DELETE named these keys: a hidden one is deleted again once durable (its write may
        have reached the store after the DELETE), and is not counted lost if it never is."""
        if self.active:
            with self._cond:
                self._deleted.update(k for k in (bytes(k) for k in keys) if k in self._hidden)

    def close(self) -> None:
        """Stop confirming (the store is closing: what is left stays hidden). Never waits."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
