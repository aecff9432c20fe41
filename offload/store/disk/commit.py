"""Group commit for the disk store: written blocks become visible in the background, in groups.

`DiskStore.put_many` returns once a block's bytes are in its slot (the caller's buffers are free
again) and hands the written slots to the `Committer`. Its thread takes everything handed over
since its last round, fdatasyncs every touched slab once, then makes all the synced blocks visible
in one index transaction. A block is visible (exists/get, and after a crash) only once durable,
as before: a put that returned True means "stored unless the sync or the commit fails", and such
a failure is counted and logged (the block then never appears; its slot is freed).

Primitives: `Committer(sync, commit, done, max_bytes)`: `submit(batch)` (non-blocking; call
`room(nbytes, timeout)` first: at most `max_bytes` written but not yet visible), `in_flight(key)`
(this process treats such keys as stored: put skips them, exists counts them), `wait_for(keys,
timeout)` (a get of a key in flight waits for its commit, then reads it from the index: never
bytes that are not durable), `cancel(keys)` / `honored(keys)` (a delete of blocks in flight),
`kick()` (start the next round now, without waiting for it),
`settle(timeout)` (everything submitted so far is committed or failed), `flush(timeout)` (the
same, and whether nothing was lost since the last flush), `backlog()` (written, not yet durable:
blocks and bytes), `close(timeout)`.

Rounds are grouped: a round starts `group_s` after the first batch it takes was submitted, or as
soon as `group_bytes` are queued for it or a caller waits (`wait_for` unless told not to hurry,
`settle`, `flush`, a `room` past the bound). Each round costs two device cache flushes (the slabs'
fdatasync, the index's synced commit); grouping keeps them to about one per `group_s` under a
stream of small puts, without delaying anyone who waits for a block to be durable. `BUSY`: what
`commit` returns while another connection holds the index (the round is retried; nothing is lost
meanwhile: the slots stay pending, owned by this process).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from offload.store.base import Backlog
from offload.store.disk.location import Location

log = logging.getLogger(__name__)

BUSY = "index busy"
RETRY_S = (0.005, 0.25)   # back-off between tries of a round while the index is busy
GROUP_S = 0.02            # a round waits this long after its first batch for more to join...
GROUP_BYTES = 64 << 20    # ... unless this much is pending, or someone waits for the round


@dataclass
class Batch:
    locs: list[Location]              # written: to sync and commit
    csums: list[int]
    failed: list[Location] = field(default_factory=list)   # write failed: slots to free
    nbytes: int = 0                   # data bytes of `locs` (the bound, the stats)


class Committer:
    def __init__(self, sync: Callable[[list[tuple[int, int]]], dict[tuple[int, int], bool]],
                 commit: Callable[[list[tuple[Location, int]], list[Location]], str],
                 done: Callable[[list[Location], list[Location], str], list[Location]],
                 max_bytes: int,
                 group_s: float = GROUP_S, group_bytes: int = GROUP_BYTES,
                 quiet: Callable[[], object] | None = None):
        """sync([(seg, slot_bytes)]) -> synced?; commit(good [(slot, csum)], slots to free) ->
        '' / BUSY / why it failed; done(committed, lost, why) after each round -> the blocks of
        `committed` that were not stored after all (their slot was taken back: lost, so the next
        `flush` says False); quiet() before each of a round's flushes (the sync, the commit):
        waits, bounded, for the reads in flight (`slab/gate.py`)."""
        self._sync, self._commit, self._done = sync, commit, done
        self._quiet = quiet or (lambda: None)
        self._max = max(1, max_bytes)
        self._group_s, self._group_bytes = group_s, min(group_bytes, self._max)
        self._first_at = 0.0                # when the oldest batch in the queue was submitted
        self._queued = 0                    # bytes in the queue (not yet taken by a round)
        self._waiting = 0                   # callers waiting for a round: start it now
        self._kicked = False                # `kick`: start the next round now
        self._cond = threading.Condition()
        self._queue: list[Batch] = []
        self._bytes = 0                     # submitted, not finished
        self._keys: dict[bytes, int] = {}   # in flight -> count
        self._submitted = self._finished = 0
        self._lost = False                  # a block lost since the last flush
        self._cancelled: set[bytes] = set()  # deleted while in flight
        self._honored: dict[bytes, int] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="offload-commit", daemon=True)
        self._thread.start()

    def room(self, nbytes: int, timeout: float) -> bool:
        """Wait (at most `timeout`) until `nbytes` more fit under the bound (always, when idle)."""
        end = time.monotonic() + timeout
        with self._cond, self._hurry():   # (a hurry that never waits is never seen)
            while self._bytes and self._bytes + nbytes > self._max:
                left = end - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._cond.wait(left)
        return True

    @contextlib.contextmanager
    def _hurry(self) -> Iterator[None]:
        """A caller waits for rounds (under the condition): the committer starts one now (woken
        only if a batch waits for its round: with none queued, it sees the count at the next)."""
        self._waiting += 1
        if self._queue:
            self._cond.notify_all()
        try:
            yield
        finally:
            self._waiting -= 1

    def submit(self, batch: Batch) -> None:
        with self._cond:
            if not self._queue:
                self._first_at = time.monotonic()
            self._queue.append(batch)
            self._queued += batch.nbytes
            self._bytes += batch.nbytes
            self._submitted += 1
            for loc in batch.locs:
                self._keys[loc.key] = self._keys.get(loc.key, 0) + 1
            self._cond.notify_all()

    def kick(self) -> None:
        """Start the next round now (for a caller about to wait on something else that waits
        for the round)."""
        with self._cond:
            self._kicked = True
            self._cond.notify_all()

    def pending(self) -> int:
        """Bytes submitted and not yet committed or failed."""
        return self._bytes

    def backlog(self) -> Backlog:
        """Blocks written and not yet durable (submitted, not committed or failed), and bytes."""
        with self._cond:
            return Backlog(len(self._keys), self._bytes)

    def in_flight(self, key: bytes) -> bool:
        return key in self._keys

    def cancel(self, keys: Sequence[bytes]) -> None:
        """Deleted while in flight: a round that has not committed them yet frees their slots
        instead (`honored` then counts them)."""
        with self._cond:
            self._cancelled.update(k for k in keys if k in self._keys)

    def honored(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` a round dropped on `cancel` (each counted once)."""
        with self._cond:
            return sum(self._honored.pop(k, 0) for k in keys)

    def wait_for(self, keys: Sequence[bytes], timeout: float, hurry: bool = True) -> bool:
        """Wait (at most `timeout`) until none of `keys` is in flight; False on timeout. `hurry`:
        start their round now (else it starts when grouping would start it)."""
        end = time.monotonic() + timeout
        with self._cond, (self._hurry() if hurry else contextlib.nullcontext()):
            while any(k in self._keys for k in keys):
                left = end - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is committed (or failed). True if it all is
        durable and visible; False on timeout or if a block was lost since the last flush."""
        with self._cond:
            if not self.settle(timeout):
                return False
            lost, self._lost = self._lost, False
        return not lost

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is committed or failed; False on timeout."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond, self._hurry():
            target = self._submitted
            while self._finished < target:
                left = None if end is None else end - time.monotonic()
                if (left is not None and left <= 0) or not self._thread.is_alive():
                    return False
                self._cond.wait(1.0 if left is None else min(left, 1.0))
        return True

    def close(self, timeout: float) -> bool:
        ok = self.settle(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=max(0.0, timeout))
        return ok

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                while not (self._closed or self._waiting or self._kicked
                           or self._queued >= self._group_bytes):
                    left = self._first_at + self._group_s - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                batches, self._queue, self._queued, self._kicked = self._queue, [], 0, False
            try:
                lost = self._round(batches)
            except Exception:  # never let the thread die: the blocks are lost, puts go on
                log.exception("disk store commit round failed; its blocks are not stored")
                lost = [loc for b in batches for loc in b.locs]
                self._done([], lost, "commit round failed")
            with self._cond:
                self._lost = self._lost or bool(lost)
                for b in batches:
                    self._bytes -= b.nbytes
                    for loc in b.locs:
                        n = self._keys.pop(loc.key, 1) - 1
                        if n:
                            self._keys[loc.key] = n
                self._finished += len(batches)
                self._cancelled.intersection_update(self._keys)
                self._cond.notify_all()

    def _round(self, batches: list[Batch]) -> list[Location]:
        locs = [loc for b in batches for loc in b.locs]
        csums = [c for b in batches for c in b.csums]
        free = [loc for b in batches for loc in b.failed]
        self._quiet()   # a flush queued ahead of a read delays it: after the reads in flight
        synced = self._sync(sorted({(loc.seg, loc.slot_bytes) for loc in locs}))
        good = [(loc, c) for loc, c in zip(locs, csums) if synced.get((loc.seg, loc.slot_bytes))]
        unsynced = [loc for loc in locs if not synced.get((loc.seg, loc.slot_bytes))]
        with self._cond:   # deleted meanwhile: freed, never made visible
            gone = {loc.key for loc, _ in good} & self._cancelled
            self._cancelled -= gone
            for k in gone:
                self._honored[k] = self._honored.get(k, 0) + 1
        if gone:
            free += [loc for loc, _ in good if loc.key in gone]
            good = [(loc, c) for loc, c in good if loc.key not in gone]
        pause = RETRY_S[0]
        self._quiet()
        while True:
            why = self._commit(good, free + unsynced)
            if why != BUSY or self._closed:   # closed: the flush deadline passed
                break
            time.sleep(pause)   # the slots stay pending (ours): retried until the index is free
            pause = min(RETRY_S[1], pause * 2)
        if why:
            self._done([], locs, why)
            return locs
        late = self._done([loc for loc, _ in good], unsynced, "fdatasync failed" if unsynced else "")
        return unsynced + late   # `late`: committed blocks whose slot was no longer ours


__all__ = ["BUSY", "Batch", "Committer"]
