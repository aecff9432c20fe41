"""The bounded cache of open slab file descriptors of one process, shared by its I/O threads.

At most `max_open` fds stay open (least recently used closed first); an fd in use by a thread is
closed only once that thread is done with it. Files are opened with O_NOFOLLOW
(`cachedir.open_file`: a symlink is refused, never followed) and O_DIRECT where the file system
allows it (in `auto` mode a refusal switches to buffered I/O, logged once). A file found missing is
remembered (`take_missing`) so the store drops its segment from the index.

Primitives: `probe_o_direct(directory, mode)`; `FdCache(directory, o_direct, max_open)` with
`use(seg, slot_bytes, buffered=False)` (a context holding the fd open; `buffered`: a second fd of
the file without O_DIRECT, for the page-cache share: `pagecache.py`), `forget`, `has_missing`, `take_missing`,
`mark_missing`, `open_count`, `close`; `SlabMissing`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import threading
from collections import OrderedDict
from typing import Iterator

from offload.errors import StoreError
from offload.store.disk import cachedir
from offload.store.disk.slab.format import segment_name

log = logging.getLogger(__name__)

MAX_OPEN = 256  # slab fds kept open per process (LRU)


def probe_o_direct(directory: str, mode: str) -> bool:
    """Whether files in `directory` can be opened with O_DIRECT (`store.o_direct`: off -> False;
    on -> True, else a `StoreError`; auto -> whether it works, a refusal logged)."""
    if mode == "off":
        return False
    # a name of its own: a pid is not (two containers' processes, two threads of one process),
    # and deleting another opener's probe made its O_EXCL create fail: "refuses O_DIRECT"
    probe = os.path.join(directory, f".o_direct_probe.{secrets.token_hex(8)}")
    try:
        os.close(cachedir.open_file(probe, os.O_RDWR | os.O_DIRECT, create=True))
        return True
    except OSError as e:
        if mode == "on":
            raise StoreError(f"store.o_direct is 'on' but {directory} refuses O_DIRECT: "
                             f"{e.strerror}; use 'auto' or 'off'") from None
        log.warning("%s refuses O_DIRECT (%s): using buffered I/O + fdatasync", directory,
                    e.strerror)
        return False
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass


class SlabMissing(FileNotFoundError):
    """A segment's slab file is gone (deleted, or lost in a power cut before it was durable)."""


class _Fd:
    __slots__ = ("fd", "refs", "evicted")

    def __init__(self, fd: int):
        self.fd, self.refs, self.evicted = fd, 0, False


class FdCache:
    def __init__(self, directory: str, o_direct: str, max_open: int = MAX_OPEN):
        self.directory = directory
        self.o_direct = o_direct  # "on" | "off" | "auto"
        self.direct_ok: bool | None = None if o_direct == "auto" else o_direct == "on"
        self.fallback_reason = ""
        self.max_open = max(1, max_open)
        # (seg, slot_bytes, buffered) -> fd
        self._fds: OrderedDict[tuple[int, int, bool], _Fd] = OrderedDict()
        self._missing: set[tuple[int, int]] = set()
        self._lock = threading.Lock()

    def path(self, seg: int, slot_bytes: int) -> str:
        return os.path.join(self.directory, segment_name(seg, slot_bytes))

    def _open(self, seg: int, slot_bytes: int, buffered: bool = False) -> int:
        path = self.path(seg, slot_bytes)
        try:
            if self.direct_ok is not False and not buffered:
                try:
                    fd = cachedir.open_file(path, os.O_RDWR | os.O_DIRECT)
                    self.direct_ok = True
                    return fd
                except OSError as e:
                    if e.errno != errno.EINVAL or self.o_direct == "on":
                        raise
                    self.direct_ok = False
                    self.fallback_reason = f"O_DIRECT refused by the file system ({e.strerror})"
                    log.warning("%s: %s; using buffered I/O", self.directory, self.fallback_reason)
            return cachedir.open_file(path, os.O_RDWR)
        except FileNotFoundError:
            self._missing.add((seg, slot_bytes))  # the caller (`use`) holds the lock
            raise SlabMissing(errno.ENOENT, "slab file missing", path) from None

    @contextlib.contextmanager
    def use(self, seg: int, slot_bytes: int, buffered: bool = False) -> Iterator[int]:
        """The segment's fd, held open until the block leaves (`buffered`: one without
        O_DIRECT)."""
        k = (seg, slot_bytes, buffered and self.direct_ok is not False)
        with self._lock:
            ent = self._fds.get(k)
            if ent is None:
                ent = self._fds[k] = _Fd(self._open(seg, slot_bytes, k[2]))
                self._trim()
            else:
                self._fds.move_to_end(k)
            ent.refs += 1
        try:
            yield ent.fd
        finally:
            with self._lock:
                ent.refs -= 1
                if ent.evicted and ent.refs == 0:
                    os.close(ent.fd)

    def _trim(self) -> None:
        while len(self._fds) > self.max_open:
            _, old = self._fds.popitem(last=False)
            old.evicted = True
            if old.refs == 0:
                os.close(old.fd)

    def forget(self, seg: int, slot_bytes: int) -> None:
        """Close a segment's fd (its file was found missing or dropped)."""
        with self._lock:
            for buffered in (False, True):
                old = self._fds.pop((seg, slot_bytes, buffered), None)
                if old is not None:
                    old.evicted = True
                    if old.refs == 0:
                        os.close(old.fd)

    def gone(self, seg: int, slot_bytes: int) -> bool:
        """Whether the segment's slab file was deleted (`fstat` of its fd: no link left; or its
        name is gone), marked missing if so: a cheap check before writing into it."""
        try:
            with self.use(seg, slot_bytes) as fd:
                if os.fstat(fd).st_nlink:
                    return False
        except SlabMissing:
            return True            # marked by `_open`
        except OSError:
            return False           # not this check's: the write reports it
        self.mark_missing(seg, slot_bytes)
        return True

    def mark_missing(self, seg: int, slot_bytes: int) -> None:
        """Remember a segment whose file was found gone (the store drops it)."""
        with self._lock:
            self._missing.add((seg, slot_bytes))

    def has_missing(self) -> bool:
        """Whether a segment was found missing since the last `take_missing` (no lock: a hint)."""
        return bool(self._missing)

    def take_missing(self) -> set[tuple[int, int]]:
        """Segments found missing since the last call."""
        with self._lock:
            got, self._missing = self._missing, set()
        return got

    def open_count(self) -> int:
        with self._lock:
            return sum(not e.evicted for e in self._fds.values())

    def close(self) -> None:
        with self._lock:
            for ent in self._fds.values():
                ent.evicted = True
                if ent.refs == 0:
                    try:
                        os.close(ent.fd)
                    except OSError:
                        pass
            self._fds.clear()
