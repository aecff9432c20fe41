"""One store over several drives: a cache directory per NVMe drive, blocks spread by key.

The drives, their placement order and their health are in `drives.py`; here the store over them.

`SpreadStore(StoreConfig)` opens one `DiskStore` per directory of `offload.store.paths` (its own
slabs, index and checksums) and is one `BlockStore` + `SlotStore` over them:

- Placement: weighted rendezvous hashing (highest random weight) of the block key over the drives
  that are in service, a drive's weight being its file system's size. Every process with the same
  paths computes the same order, so a reader finds a block without a global lookup; a drive taken
  out or added moves only the blocks ranked first on it. A block is written to the first drive of
  its order that is in service and not full; it is looked up on the first two (the second holds
  what was written while the first was out, full, or not yet added).
- One cap: `capacity` is split over the drives by weight (a drive whose size is unknown, out since
  the start, counts as the mean), each drive's share is that drive's cap in its own index (all
  processes together), and `min_free` is each drive's own floor. Keys spread in proportion to the
  shares, so every drive reaches its watermark at the same pace and evicts its least recently used
  blocks: one eviction order, drive by drive.
- Parallel: a batch is split by drive and each part runs on its drive's own I/O threads at once,
  so a large prefix loads at the sum of the drives' bandwidth.
- Failure: a drive whose directory disappears or changes device (unmounted), whose index goes
  missing, or whose probe write fails (I/O error, read-only remount) is taken out: its blocks are
  misses, the others serve, and nothing is read from it. A drive whose file system is below its
  floor is full: read, not written. A monitor thread checks every `CHECK_S` and reopens a drive
  that is back (its blocks kept). A directory that does not exist is created only when no drive
  of the set holds a cache yet (a first start); later it is a drive not mounted, taken out.

The data path never raises (`never_raises`), like every store; `drives()` says each drive's state.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence, TypeVar

from offload.config import StoreConfig
from offload.keys import Namespace
from offload.store.base import Backlog, Buffer, Slot, SlotMedium, StoreStats, all_false, never_raises
from offload.store.disk.spread.drives import Drive, DriveSet, _probe, rank
from offload.store.disk.store import DiskStore, fs_free_bytes

log = logging.getLogger(__name__)

T = TypeVar("T")


class SpreadStore:
    slot_medium: SlotMedium = "file"

    def __init__(self, cfg: StoreConfig, *, free_bytes: Callable[[str], int] = fs_free_bytes,
                 probe: Callable[[str], str] = _probe, monitor: bool = True,
                 open_drive: Callable[[StoreConfig], DiskStore] | None = None):
        self.cfg = cfg
        self._set = DriveSet(cfg, free_bytes=free_bytes, probe=probe, monitor=monitor,
                             open_drive=open_drive)
        self._pool = ThreadPoolExecutor(len(self._set.all), thread_name_prefix="offload-drive")

    # ---- drives (`drives.py`) -----------------------------------------------------------------

    def check(self) -> None:
        """Check every drive once (the monitor's round; tests call it directly)."""
        self._set.check()

    def drives(self) -> list[Drive]:
        """Every drive of the set, in the order of `paths` (a snapshot of their state)."""
        return self._set.drives()

    def parts(self) -> Sequence[DiskStore]:
        """The stores of the drives in service (`offload.store.base.Composite`)."""
        return self.drive_stores()

    def drive_stores(self) -> list[DiskStore]:
        """The stores of the drives in service (events, tools)."""
        return self._set.stores()

    # ---- routing ------------------------------------------------------------------------------

    def _lookup(self, keys: Sequence[bytes]) -> list[list[Drive]]:
        """Per key, the (up to two) drives it may be on."""
        live = self._set.usable()
        return [rank(k, live)[:2] for k in keys]

    def _target(self, keys: Sequence[bytes]) -> list[Drive | None]:
        """Per key, the drive a put writes it to: the first in service and not full."""
        live = [d for d in self._set.usable() if d.state == "in"]
        return [rank(k, live)[0] if live else None for k in keys]

    def _fan(self, parts: dict[int, tuple[Drive, list[int]]],
             call: Callable[[DiskStore, list[int]], T]) -> list[tuple[list[int], T | None]]:
        """Run `call(store, indexes)` for every drive's part at once; a part whose drive left
        meanwhile gives None."""
        def one(d: Drive, idx: list[int]) -> T | None:
            store = d.store
            return None if store is None else call(store, idx)

        items = list(parts.values())
        if len(items) == 1:
            d, idx = items[0]
            return [(idx, one(d, idx))]
        futs = [(idx, self._pool.submit(one, d, idx)) for d, idx in items]
        return [(idx, f.result()) for idx, f in futs]

    def _on_second(self, keys: Sequence[bytes], where: list[list[Drive]], missed: list[int]
                   ) -> list[tuple[int, Drive | None]]:
        """Of the keys `missed` on their first drive, those their second drive holds (written
        there while the first was out or full), with that drive: asked with `exists` first, so a
        block on neither counts one miss, not two."""
        second = self._group([(i, where[i][1]) for i in missed if len(where[i]) > 1])
        held: list[tuple[int, Drive | None]] = []
        for idx, got in self._fan(second, lambda s, ix: s.exists_many([keys[i] for i in ix])):
            held += [(i, where[i][1]) for i, ok in zip(idx, got or []) if ok]
        return held

    @staticmethod
    def _group(pairs: Sequence[tuple[int, Drive | None]]) -> dict[int, tuple[Drive, list[int]]]:
        out: dict[int, tuple[Drive, list[int]]] = {}
        for i, d in pairs:
            if d is not None:
                out.setdefault(id(d), (d, []))[1].append(i)
        return out

    # ---- data path ----------------------------------------------------------------------------

    @never_raises("spread put", all_false)
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]) -> list[bool]:
        # (a caller puts what `exists` said is missing, on either drive a block may be on; a block
        # put again anyway while a copy sits on its second drive is stored twice, both verified)
        return self._put(keys, blocks, lambda s, k, b: s.put_many(k, b))

    @never_raises("spread put (promotion)", all_false)
    def promote_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]
                     ) -> list[bool]:
        """`put_many` on a read's path: each drive's store waits as a read does
        (`DiskStore.promote_many`)."""
        return self._put(keys, blocks, lambda s, k, b: s.promote_many(k, b))

    def _put(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]],
             put: Callable[[DiskStore, list[bytes], list[Sequence[Buffer]]], list[bool]]
             ) -> list[bool]:
        out = [False] * len(keys)
        todo = self._group(list(enumerate(self._target(keys))))
        for idx, got in self._fan(todo, lambda s, ix: put(
                s, [keys[i] for i in ix], [blocks[i] for i in ix])):
            for i, ok in zip(idx, got or []):
                out[i] = bool(ok)
        return out

    @never_raises("spread get", all_false)
    def get_many(self, keys: Sequence[bytes], dests: Sequence[Sequence[Buffer]]) -> list[bool]:
        out = [False] * len(keys)
        where = self._lookup(keys)

        def read(pairs: list[tuple[int, Drive | None]]) -> None:
            for idx, got in self._fan(self._group(pairs), lambda s, ix: s.get_many(
                    [keys[i] for i in ix], [dests[i] for i in ix])):
                for i, ok in zip(idx, got or []):
                    out[i] = bool(ok)

        read([(i, w[0]) for i, w in enumerate(where) if w])
        held = self._on_second(keys, where, [i for i, ok in enumerate(out) if not ok])
        if held:
            read(held)
        return out

    @never_raises("spread exists", all_false)
    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        out = [False] * len(keys)
        where = self._lookup(keys)
        for level in (0, 1):
            parts = self._group([(i, w[level]) for i, w in enumerate(where)
                                 if not out[i] and len(w) > level])
            for idx, got in self._fan(parts, lambda s, ix: s.exists_many(
                    [keys[i] for i in ix])):
                for i, ok in zip(idx, got or []):
                    out[i] = out[i] or bool(ok)
        return out

    @never_raises("spread delete", lambda *_a, **_k: 0)
    def delete_many(self, keys: Sequence[bytes]) -> int:
        where = self._lookup(keys)
        gone = [False] * len(keys)
        for level in (0, 1):
            parts = self._group([(i, w[level]) for i, w in enumerate(where) if len(w) > level])
            for idx, held in self._fan(parts, lambda s, ix: s.exists_many(
                    [keys[i] for i in ix])):
                for i, h in zip(idx, held or []):
                    gone[i] = gone[i] or bool(h)
            self._fan(parts, lambda s, ix: s.delete_many([keys[i] for i in ix]))
        return sum(gone)

    @never_raises("spread durable", all_false)
    def durable(self, keys: Sequence[bytes], hurry: bool = True) -> list[bool]:
        """Per key, whether this process's put of it is durable now (waited for, per drive)."""
        out = [False] * len(keys)
        where = self._lookup(keys)
        for level in (0, 1):
            parts = self._group([(i, w[level]) for i, w in enumerate(where)
                                 if not out[i] and len(w) > level])
            for idx, got in self._fan(parts, lambda s, ix: s.durable(
                    [keys[i] for i in ix], hurry)):
                for i, ok in zip(idx, got or []):
                    out[i] = out[i] or bool(ok)
        return out

    def backlog(self) -> dict[str, Backlog]:
        """Every drive's blocks written and not yet durable, as one local tier."""
        parts = [s.backlog()["local"] for s in self.drive_stores()]
        return {"local": Backlog(sum(b.pages for b in parts), sum(b.bytes for b in parts))}

    def commit_now(self) -> None:
        for s in self.drive_stores():
            s.commit_now()

    def flush(self, timeout: float | None = None) -> bool:
        """Every drive's puts so far durable; False if one was lost (or a drive left)."""
        return all([s.flush(timeout) for s in self.drive_stores()])

    # ---- slots (GDS: a file per drive) ----------------------------------------------------------

    def _by_path(self, slots: Sequence[Slot]) -> dict[int, tuple[Drive, list[int]]]:
        drives = self._set.with_store()
        pairs: list[tuple[int, Drive | None]] = []
        for i, s in enumerate(slots):
            d = next((d for d in drives if s.path.startswith(d.path.rstrip("/") + "/")), None)
            pairs.append((i, d))
        return self._group(pairs)

    @never_raises("spread reserve_slots", lambda _s, keys, *_: [None] * len(keys))
    def reserve_slots(self, keys: Sequence[bytes], sizes: Sequence[int]) -> list[Slot | None]:
        out: list[Slot | None] = [None] * len(keys)
        parts = self._group(list(enumerate(self._target(keys))))
        for idx, got in self._fan(parts, lambda s, ix: s.reserve_slots(
                [keys[i] for i in ix], [sizes[i] for i in ix])):
            for i, slot in zip(idx, got or []):
                out[i] = slot
        return out

    @never_raises("spread commit_slots", lambda _s, slots, *_: [False] * len(slots))
    def commit_slots(self, slots: Sequence[Slot], checksums: Sequence[int] | None = None
                     ) -> list[bool]:
        out = [False] * len(slots)
        for idx, got in self._fan(self._by_path(slots), lambda s, ix: s.commit_slots(
                [slots[i] for i in ix], None if checksums is None else [checksums[i] for i in ix])):
            for i, ok in zip(idx, got or []):
                out[i] = bool(ok)
        return out

    @never_raises("spread abort_slots", lambda *_a, **_k: None)
    def abort_slots(self, slots: Sequence[Slot]) -> None:
        self._fan(self._by_path(slots), lambda s, ix: s.abort_slots([slots[i] for i in ix]))

    @never_raises("spread pin_slots", lambda _s, keys, *_: [None] * len(keys))
    def pin_slots(self, keys: Sequence[bytes]) -> list[Slot | None]:
        out: list[Slot | None] = [None] * len(keys)
        where = self._lookup(keys)

        def pin(pairs: list[tuple[int, Drive | None]]) -> None:
            for idx, got in self._fan(self._group(pairs),
                                      lambda s, ix: s.pin_slots([keys[i] for i in ix])):
                for i, slot in zip(idx, got or []):
                    out[i] = slot

        pin([(i, w[0]) for i, w in enumerate(where) if w])
        held = self._on_second(keys, where, [i for i, slot in enumerate(out) if slot is None])
        if held:
            pin(held)
        return out

    @never_raises("spread unpin_slots", lambda *_a, **_k: None)
    def unpin_slots(self, slots: Sequence[Slot], ok: Sequence[bool] | None = None) -> None:
        self._fan(self._by_path(slots), lambda s, ix: s.unpin_slots(
            [slots[i] for i in ix], None if ok is None else [ok[i] for i in ix]))

    def arena_region(self) -> tuple[int, int] | None:
        return None

    # ---- control path -------------------------------------------------------------------------

    def _each(self, call: Callable[[DiskStore], T]) -> list[T]:
        return [call(s) for s in self.drive_stores()]

    def register_namespace(self, ns: Namespace) -> None:
        self._each(lambda s: s.register_namespace(ns))

    def clear(self, namespace: bytes | None = None) -> int:
        return sum(self._each(lambda s: s.clear(namespace)))

    def evict_to(self, used_bytes: int) -> int:
        """Evict least-recently-used blocks until at most `used_bytes` are used in all: each
        drive down to its share of it."""
        total = sum(d.capacity for d in self._set.all) or 1
        n = 0
        for d in self._set.all:
            if d.store is not None:
                n += d.store.evict_to(int(used_bytes * d.capacity / total))
        return n

    def tier_stats(self) -> dict[str, StoreStats]:
        return {"local": self.stats()}

    def stats(self) -> StoreStats:
        s = StoreStats()
        per: list[dict[str, Any]] = []
        for d in self.drives():
            row: dict[str, Any] = {"path": d.path, "state": d.state, "why": d.why,
                                   "capacity": d.capacity, "outages": d.outages}
            store = d.store
            if store is not None:
                ds = store.stats()
                for f in dataclasses.fields(StoreStats):
                    if f.name not in ("extra", "capacity"):
                        setattr(s, f.name, getattr(s, f.name) + getattr(ds, f.name))
                row.update(blocks=ds.blocks, bytes_used=ds.bytes_used, hits=ds.hits,
                           bytes_read=ds.bytes_read, bytes_written=ds.bytes_written)
            per.append(row)
        s.capacity = self.cfg.capacity
        s.extra = {"drives": per, "directory": [d.path for d in self._set.all],
                   "drives_out": sum(r["state"] == "out" for r in per)}
        return s

    def close(self) -> None:
        if self._set.closed:
            return
        self._set.close()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "SpreadStore":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


__all__ = ["SpreadStore"]
