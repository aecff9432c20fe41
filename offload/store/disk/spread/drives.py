"""The drives of a spread store (`store.py`): where a block goes and whether a drive serves.

Primitives: `Drive` (one directory of the set: its weight, share of the cap, store and state
`in | full | out`, with why), `rank(key, drives)` (weighted rendezvous order: where a block is
written and looked up), `DriveSet` (the set: built from `StoreConfig`, opens each drive's
`DiskStore`, `check()` takes out a drive that is gone, remounted, lost its index or fails its probe
and reopens one that is back; a monitor thread runs it every `CHECK_S`, the probe write every
`PROBE_S`), `_probe(path)` ('' or why a drive failed its write-and-read-back).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from offload.config import Size, StoreConfig
from offload.errors import StoreError
from offload.store.disk import cachedir
from offload.store.disk.store import DiskStore

log = logging.getLogger(__name__)

CHECK_S = 1.0          # the monitor checks every drive this often
PROBE_S = 10.0         # ... and writes its probe file this often
INDEX = "index.db"
PROBE = ".drive-probe"
MIN_SHARE = 1 << 20    # a drive's cap is at least this (the disk store's own minimum)

DriveState = Literal["in", "full", "out"]


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


class DriveSet:
    """The drives of one `SpreadStore`: their shares of the cap, their stores, their health (each
    opened and probed; taken out, and reopened once back, by `check`, the monitor's round)."""

    def __init__(self, cfg: StoreConfig, *, free_bytes: Callable[[str], int],
                 probe: Callable[[str], str], monitor: bool,
                 open_drive: Callable[[StoreConfig], DiskStore] | None):
        dirs = [os.path.abspath(d) for d in cfg.directories()]
        if len(dirs) < 1:
            raise StoreError("offload.store.paths: no directory")
        self.cfg = cfg
        self._free_bytes = free_bytes
        self._probe = probe
        self._open_drive = open_drive or (lambda c: DiskStore(c, free_bytes=free_bytes))
        self.lock = threading.Lock()
        self.closed = False
        fresh = not any(os.path.isfile(os.path.join(d, INDEX)) for d in dirs)
        # a drive missing after the first start has no size of its own (its parent's file system
        # would stand in for it): unknown, the mean below
        self.all = [Drive(d, _fs_size(d) if fresh or os.path.isdir(d) else 0.0, _seed(d))
                        for d in dirs]
        known = [d.weight for d in self.all if d.weight > 0]
        mean = sum(known) / len(known) if known else 1.0
        for d in self.all:
            d.weight = d.weight or mean
        total = sum(d.weight for d in self.all)
        for d in self.all:
            d.capacity = max(MIN_SHARE, int(cfg.capacity * d.weight / total))
            self._open(d, create=fresh)
        if not any(d.usable() for d in self.all):
            raise StoreError("offload.store.paths: no drive could be opened: " + "; ".join(
                f"{d.path}: {d.why}" for d in self.all))
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        if monitor:
            self._monitor = threading.Thread(target=self._watch, daemon=True,
                                             name="offload-drives")
            self._monitor.start()

    # ---- health ---------------------------------------------------------------------------------


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
        with self.lock:
            d.store, d.dev, d.probed = store, _ident(d.path), time.monotonic()
            self._set(d, "in", "")
        return True

    def _on_root_alone(self, path: str) -> bool:
        try:
            root = os.stat("/").st_dev
            mine = os.stat(path).st_dev
        except OSError:
            return False
        others = [o for o in self.all if o.path != path and o.dev is not None]
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
        with self.lock:
            store, d.store = d.store, None
            self._set(d, "out", why)
        if store is not None:   # in the background: a dead drive's close may wait on I/O
            threading.Thread(target=_close_quietly, args=(store,), daemon=True,
                             name="offload-drive-close").start()
        return False

    def check(self) -> None:
        """Check every drive once (the monitor's round; tests call it directly)."""
        for d in self.all:
            if self.closed:
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
            with self.lock:
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
        with self.lock:
            return [dataclasses.replace(d) for d in self.all]

    def with_store(self) -> list[Drive]:
        """The drives that have a store now (in service or full)."""
        with self.lock:
            return [d for d in self.all if d.store is not None]

    def stores(self) -> list[DiskStore]:
        """The stores of the drives in service (events, tools)."""
        return [d.store for d in self.with_store() if d.store is not None]

    def usable(self) -> list[Drive]:
        with self.lock:
            return [d for d in self.all if d.usable()]

    def close(self) -> None:
        """Stop the monitor, then close every drive's store (best effort)."""
        self.closed = True
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(5)
        for s in self.stores():
            _close_quietly(s)


def _close_quietly(store: DiskStore) -> None:
    try:
        store.close()
    except Exception as e:  # noqa: BLE001 - a lost drive's close is best effort
        log.warning("closing the store of %s: %s", store.directory, e)


__all__ = ["CHECK_S", "PROBE_S", "Drive", "DriveSet", "DriveState", "rank"]
