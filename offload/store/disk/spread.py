"""One store over several drives: a cache directory per NVMe drive, blocks spread by key.

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
import math
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence, TypeVar

from offload.config import Size, StoreConfig
from offload.errors import StoreError
from offload.keys import Namespace
from offload.store.base import Backlog, Buffer, Slot, SlotMedium, StoreStats, all_false, never_raises
from offload.store.disk import cachedir
from offload.store.disk.store import DiskStore, fs_free_bytes

log = logging.getLogger(__name__)

CHECK_S = 1.0          # the monitor checks every drive this often
PROBE_S = 10.0         # ... and writes its probe file this often
INDEX = "index.db"
PROBE = ".drive-probe"
MIN_SHARE = 1 << 20    # a drive's cap is at least this (the disk store's own minimum)

DriveState = Literal["in", "full", "out"]
T = TypeVar("T")


@dataclass
class Drive:
    """One directory of the set: its store while in service, why it is not."""
    path: str
    weight: float                  # the file system's size in bytes (0: not known)
    seed: int                      # the rendezvous seed (from the path)
    capacity: int = 0              # this drive's share of the cap
    store: DiskStore | None = None
    state: DriveState = "out"
    why: str = "not opened yet"
    since: float = 0.0             # wall time of the last state change
    dev: tuple[int, int] | None = None    # (st_dev, st_ino) of the directory when opened
    probed: float = 0.0            # monotonic time of the last probe write
    outages: int = 0

    def usable(self) -> bool:
        return self.state != "out" and self.store is not None


def _seed(path: str) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(os.path.normpath(path).encode())


def _fs_size(path: str) -> float:
    """The size of the file system holding `path` (or its nearest existing ancestor)."""
    p = os.path.abspath(path)
    while True:
        try:
            st = os.statvfs(p)
            return float(st.f_blocks * st.f_frsize)
        except OSError:
            if p == os.path.dirname(p):
                return 0.0
            p = os.path.dirname(p)


def _ident(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _probe(path: str) -> str:
    """Write, sync and read back a small file in the directory: '' or why the drive failed."""
    # a name of this probe's own (O_EXCL, never through a link): with one name, another process
    # probing the same drive truncated or deleted the file between our write and read-back, and
    # took a sound drive out ("read back other bytes", "No such file or directory")
    p = os.path.join(path, f"{PROBE}.{secrets.token_hex(8)}")
    data = os.urandom(512)
    try:
        fd = cachedir.open_file(p, os.O_RDWR, create=True)
        try:
            os.write(fd, data)
            os.fsync(fd)
            back = os.pread(fd, len(data), 0)
        finally:
            os.close(fd)
        os.unlink(p)
    except OSError as e:
        return f"probe write failed: {e.strerror or e}"
    return "" if back == data else "probe read back other bytes"


def rank(key: bytes, drives: Sequence[Drive]) -> list[Drive]:
    """The drives in `key`'s rendezvous order (weighted: score = -weight / ln(u))."""
    import xxhash

    def score(d: Drive) -> float:
        u = (xxhash.xxh3_64_intdigest(key, seed=d.seed) + 1) / 18446744073709551617.0
        return -(d.weight or 1.0) / math.log(u)

    return sorted(drives, key=score, reverse=True)


class SpreadStore:
    slot_medium: SlotMedium = "file"

    def __init__(self, cfg: StoreConfig, *, free_bytes: Callable[[str], int] = fs_free_bytes,
                 probe: Callable[[str], str] = _probe, monitor: bool = True,
                 open_drive: Callable[[StoreConfig], DiskStore] | None = None):
        dirs = [os.path.abspath(d) for d in cfg.directories()]
        if len(dirs) < 1:
            raise StoreError("offload.store.paths: no directory")
        self.cfg = cfg
        self._free_bytes = free_bytes
        self._probe = probe
        self._open_drive = open_drive or (lambda c: DiskStore(c, free_bytes=free_bytes))
        self._lock = threading.Lock()
        self._closed = False
        fresh = not any(os.path.isfile(os.path.join(d, INDEX)) for d in dirs)
        # a drive missing after the first start has no size of its own (its parent's file system
        # would stand in for it): unknown, the mean below
        self._drives = [Drive(d, _fs_size(d) if fresh or os.path.isdir(d) else 0.0, _seed(d))
                        for d in dirs]
        known = [d.weight for d in self._drives if d.weight > 0]
        mean = sum(known) / len(known) if known else 1.0
        for d in self._drives:
            d.weight = d.weight or mean
        total = sum(d.weight for d in self._drives)
        for d in self._drives:
            d.capacity = max(MIN_SHARE, int(cfg.capacity * d.weight / total))
            self._open(d, create=fresh)
        if not any(d.usable() for d in self._drives):
            raise StoreError("offload.store.paths: no drive could be opened: " + "; ".join(
                f"{d.path}: {d.why}" for d in self._drives))
        self._pool = ThreadPoolExecutor(len(dirs), thread_name_prefix="offload-drive")
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        if monitor:
            self._monitor = threading.Thread(target=self._watch, daemon=True,
                                             name="offload-drives")
            self._monitor.start()

    # ---- drives -------------------------------------------------------------------------------

    def _open(self, d: Drive, create: bool = False) -> bool:
        """Open (or reopen) a drive's store; False with `d.why` set if it cannot serve. `create`:
        a missing directory is made (a first start: no drive of the set holds a cache yet)."""
        if not create and not os.path.isdir(d.path):
            return self._out(d, "the directory does not exist (drive not mounted?)")
        if not os.path.isfile(os.path.join(d.path, INDEX)) and self._on_root_alone(d.path):
            return self._out(d, "an empty directory on the root file system while the other "
                                "drives are elsewhere (drive not mounted?)")
        try:
            store = self._open_drive(dataclasses.replace(
                self.cfg, path=d.path, paths=(), capacity=Size(d.capacity)))
        except (StoreError, OSError) as e:
            return self._out(d, f"cannot open: {e}")
        why = self._probe(d.path)
        if why:
            store.close()
            return self._out(d, why)
        with self._lock:
            d.store, d.dev, d.probed = store, _ident(d.path), time.monotonic()
            self._set(d, "in", "")
        return True

    def _on_root_alone(self, path: str) -> bool:
        try:
            root = os.stat("/").st_dev
            mine = os.stat(path).st_dev
        except OSError:
            return False
        others = [o for o in self._drives if o.path != path and o.dev is not None]
        return mine == root and any(o.dev is not None and o.dev[0] != root for o in others)

    def _set(self, d: Drive, state: DriveState, why: str) -> None:
        if d.state != state:
            d.since = time.time()
            if state == "out":
                d.outages += 1
        was, d.state, d.why = d.state, state, why
        if was != state and d.since:
            level = logging.WARNING if state != "in" else logging.INFO
            log.log(level, "drive %s: %s%s", d.path, {"in": "in service", "full": "full (read, "
                    "not written)", "out": "taken out"}[state], f": {why}" if why else "")

    def _out(self, d: Drive, why: str) -> bool:
        with self._lock:
            store, d.store = d.store, None
            self._set(d, "out", why)
        if store is not None:   # in the background: a dead drive's close may wait on I/O
            threading.Thread(target=_close_quietly, args=(store,), daemon=True,
                             name="offload-drive-close").start()
        return False

    def check(self) -> None:
        """Check every drive once (the monitor's round; tests call it directly)."""
        for d in self._drives:
            if self._closed:
                return
            if d.store is None:
                self._open(d)
                continue
            why = self._health(d)
            if why:
                self._out(d, why)
                continue
            try:
                full = self._free_bytes(d.path) < self.cfg.min_free
            except OSError as e:
                self._out(d, f"free space unknown: {e}")
                continue
            with self._lock:
                if d.store is not None:
                    self._set(d, "full" if full else "in",
                              "file system below offload.store.min_free" if full else "")

    def _health(self, d: Drive) -> str:
        try:
            if _ident(d.path) != d.dev:
                return "the directory is another one now (unmounted or replaced)"
        except OSError as e:
            return f"the directory is gone: {e.strerror or e}"
        if not os.path.isfile(os.path.join(d.path, INDEX)):
            return "its index.db is gone"
        if time.monotonic() - d.probed >= PROBE_S:
            d.probed = time.monotonic()
            return self._probe(d.path)
        return ""

    def _watch(self) -> None:
        while not self._stop.wait(CHECK_S):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the monitor must keep going
                log.exception("drive check failed")

    def drives(self) -> list[Drive]:
        """Every drive of the set, in the order of `paths` (a snapshot of their state)."""
        with self._lock:
            return [dataclasses.replace(d) for d in self._drives]

    def parts(self) -> Sequence[DiskStore]:
        """The stores of the drives in service (`offload.store.base.Composite`)."""
        return self.drive_stores()

    def drive_stores(self) -> list[DiskStore]:
        """The stores of the drives in service (events, tools)."""
        with self._lock:
            return [d.store for d in self._drives if d.store is not None]

    # ---- routing ------------------------------------------------------------------------------

    def _usable(self) -> list[Drive]:
        with self._lock:
            return [d for d in self._drives if d.usable()]

    def _lookup(self, keys: Sequence[bytes]) -> list[list[Drive]]:
        """Per key, the (up to two) drives it may be on."""
        live = self._usable()
        return [rank(k, live)[:2] for k in keys]

    def _target(self, keys: Sequence[bytes]) -> list[Drive | None]:
        """Per key, the drive a put writes it to: the first in service and not full."""
        live = [d for d in self._usable() if d.state == "in"]
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
        with self._lock:
            drives = [d for d in self._drives if d.store is not None]
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
        total = sum(d.capacity for d in self._drives) or 1
        n = 0
        for d in self._drives:
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
        s.extra = {"drives": per, "directory": [d.path for d in self._drives],
                   "drives_out": sum(r["state"] == "out" for r in per)}
        return s

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(5)
        for s in self.drive_stores():
            _close_quietly(s)
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "SpreadStore":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _close_quietly(store: DiskStore) -> None:
    try:
        store.close()
    except Exception as e:  # noqa: BLE001 - a lost drive's close is best effort
        log.warning("closing the store of %s: %s", store.directory, e)


__all__ = ["CHECK_S", "Drive", "SpreadStore", "rank"]
