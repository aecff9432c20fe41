"""Slab files: the bytes of the disk store. No bookkeeping here (that is `index.py`).

The slot format (names, header, checksums) is in `disk/slab/format.py`; the open
fds in `fdcache.py`. Slots are written without fallocate (the file grows as O_DIRECT writes land)
and hole-punched when freed, so the disk holds only live blocks. I/O is O_DIRECT where the file
system allows (else buffered, logged once), vectored straight from/into the caller's buffers when
they are aligned, through a per-thread aligned bounce buffer when they are not; the header goes in
the same vectored call as the data.

Files are created 0600 with O_EXCL and opened with O_NOFOLLOW (`cachedir.open_file`): a symlink is
refused, never followed. A new slab's name is fsync'ed into the directory before any block in it
is committed. A freed slot's header stops naming its block (hole punched, else zeroed).

Every read and write call goes through the slabs' `IoGate` (`gate.py`): reads before writes.
With a page-cache budget (`store.page_cache`, O_DIRECT on) blocks are written through a buffered
fd and the newest stay in the page cache up to the budget; a read of a slot the kernel holds whole
goes through the buffered fd without the gate (`pagecache.py`), verified as any other.

Primitives: `SlabFiles` (one directory's slabs: `create`, `use` (an fd), `sync`, `free`,
`write_block` / `read_block` / `write_header` / `read_header` (called from I/O threads; writes
return a `WriteOutcome`, reads a `ReadOutcome`; never raise), `allocated_slots`),
`cached_slot` (whether a slot is in the page cache, no I/O), `kept`, `HeaderAreas` (per-thread
header buffers), `aligned`, `reason`, `read_error`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import stat
import threading
import time
from typing import ContextManager, Sequence

from offload.store.base import Buffer
from offload.store.disk import cachedir
from offload.store.disk.slab import pagecache
from offload.store.disk.slab.fdcache import MAX_OPEN, FdCache, SlabMissing
from offload.store.disk.slab.format import (
    ALIGN,
    HEADER_BYTES,
    READ_CACHED,
    READ_OK,
    WRITTEN,
    Header,
    ReadOutcome,
    WriteOutcome,
    align_up,
    corrupt,
    pack_header_into,
    read_failed,
    unpack_header,
    verify,
    write_failed,
)
from offload.store.disk.slab.gate import IoGate

log = logging.getLogger(__name__)

IOV_MAX = 1024
# A write call moves at most this much (a run or a large block is cut into pieces of it): a read
# that arrives while writes run waits at the device behind one piece, not a 16 MiB run.
WRITE_PIECE_BYTES = 1 << 20


def address(buf: Buffer) -> int:
    """Where a buffer's bytes start (ctypes: no numpy import on the first put)."""
    if isinstance(buf, bytes):
        return ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value or 0
    mv = memoryview(buf)
    if not mv.readonly and mv.nbytes:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv if mv.format == "B" else mv.cast("B")))
    import numpy as np  # a read-only view of some other object (rare)

    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def aligned(bufs: Sequence[Buffer]) -> bool:
    """Every buffer 4 KiB aligned in address and length (an O_DIRECT source or destination)."""
    for b in bufs:
        n = memoryview(b).nbytes
        if n % ALIGN or (n and address(b) % ALIGN):
            return False
    return True


_libc = None


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Free a slot's disk space (FALLOC_FL_PUNCH_HOLE | KEEP_SIZE). False if unsupported."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return _libc.fallocate(fd, 0x01 | 0x02, offset, length) == 0


def cut(iov: Sequence[Buffer], piece: int) -> list[list[Buffer]]:
    """`iov` as consecutive lists of at most `piece` bytes each (at most IOV_MAX buffers); a
    buffer is sliced only where it crosses a piece's end."""
    out: list[list[Buffer]] = [[]]
    room = piece
    for b in iov:
        n = memoryview(b).nbytes
        if n <= room and len(out[-1]) < IOV_MAX:
            out[-1].append(b)
            room -= n
            continue
        mv = memoryview(b).cast("B")
        pos = 0
        while pos < n:
            if not room or len(out[-1]) >= IOV_MAX:
                out.append([])
                room = piece
            take = min(room, n - pos)
            out[-1].append(mv[pos:pos + take] if take < n else b)
            pos += take
            room -= take
    return [p for p in out if p]


class HeaderAreas(threading.local):
    """Per-thread, 4 KiB-aligned header areas: `write(n)` for headers to write (only ever packed,
    so their tails stay zero), `read(n)` for headers read from disk."""

    def __init__(self) -> None:
        self._w: mmap.mmap | None = None
        self._r: mmap.mmap | None = None
        self.bounce: mmap.mmap | None = None

    @staticmethod
    def _views(buf: mmap.mmap, n: int) -> list[memoryview]:
        mv = memoryview(buf)
        return [mv[j * HEADER_BYTES:(j + 1) * HEADER_BYTES] for j in range(n)]

    def write(self, n: int) -> list[memoryview]:
        if self._w is None or len(self._w) < n * HEADER_BYTES:
            self._w = mmap.mmap(-1, max(n, 8) * HEADER_BYTES)
        return self._views(self._w, n)

    def read(self, n: int) -> list[memoryview]:
        if self._r is None or len(self._r) < n * HEADER_BYTES:
            self._r = mmap.mmap(-1, max(n, 8) * HEADER_BYTES)
        return self._views(self._r, n)

    def bounce_of(self, size: int) -> mmap.mmap:
        if self.bounce is None or len(self.bounce) < size:
            if self.bounce is not None:
                self.bounce.close()
            self.bounce = mmap.mmap(-1, align_up(size, 1 << 20))
        return self.bounce


MISSING = "corrupt: slab file missing"


def reason(e: OSError, prefix: str = "") -> str:
    """The per-block reason for an I/O error ('corrupt: ...' when the slab file is missing)."""
    if isinstance(e, SlabMissing):
        return MISSING
    return f"{prefix}{errno.errorcode.get(e.errno or 0, e.errno)}: {e.strerror}"


def read_error(e: OSError) -> ReadOutcome:
    """A read's outcome for an I/O error: corrupt when the slab file is missing (its blocks are
    gone), else failed (a miss, the block kept)."""
    if isinstance(e, SlabMissing):
        return corrupt("slab file missing")
    return read_failed(reason(e, "io error "))


def write_error(e: OSError) -> WriteOutcome:
    """A write's outcome for an I/O error: failed, with its reason."""
    return write_failed(reason(e))


_zero_header: mmap.mmap | None = None


def _zeros() -> mmap.mmap:
    global _zero_header
    if _zero_header is None:
        _zero_header = mmap.mmap(-1, HEADER_BYTES)  # aligned, all zero: an O_DIRECT source
    return _zero_header


class SlabFiles:
    """The slab files of one directory, shared by the threads of one process (fds: `FdCache`)."""

    def __init__(self, directory: str, o_direct: str, max_open: int = MAX_OPEN,
                 gate: IoGate | None = None, page_cache: int = 0):
        self.directory = directory
        self.fds = FdCache(directory, o_direct, max_open)
        self.headers = HeaderAreas()
        self.gate = gate or IoGate()   # reads before writes at the device (`gate.py`)
        # the page-cache share (`pagecache.py`): only beside O_DIRECT (buffered I/O caches all)
        self.cache = (pagecache.PageCache(page_cache, self._drop)
                      if page_cache > 0 and o_direct == "on" else None)

    def path(self, seg: int, slot_bytes: int) -> str:
        return self.fds.path(seg, slot_bytes)

    def use(self, seg: int, slot_bytes: int, buffered: bool = False) -> ContextManager[int]:
        """The segment's fd, held open until the block leaves (`buffered`: without O_DIRECT)."""
        return self.fds.use(seg, slot_bytes, buffered)

    def _drop(self, seg: int, slot_bytes: int, off: int, n: int) -> bool:
        """A slot past the page-cache budget: written back and dropped from the page cache
        (False: pages of it stayed, to be tried again)."""
        try:
            with self.use(seg, slot_bytes) as fd:
                return pagecache.drop(fd, off, n)
        except OSError:   # a slab gone holds nothing cached
            return True

    def kept(self, seg: int, slot_bytes: int, slot: int, length: int) -> None:
        """A block now in the page cache (written or read buffered): the budget's newest."""
        if self.cache is not None:
            self.cache.keep(seg, slot_bytes, slot, HEADER_BYTES + align_up(length))

    def cached_slot(self, seg: int, slot_bytes: int, slot: int, length: int) -> bool:
        """Whether the kernel holds (nearly: `pagecache.WARM_SHARE`) a block's range, header and
        data, in the page cache, asked without I/O; False without a budget or `cachestat`."""
        if self.cache is None:
            return False
        try:
            with self.use(seg, slot_bytes) as fd:
                return pagecache.warm(fd, slot * slot_bytes, HEADER_BYTES + length)
        except OSError:
            return False

    def forget(self, seg: int, slot_bytes: int) -> None:
        self.fds.forget(seg, slot_bytes)

    def take_missing(self) -> set[tuple[int, int]]:
        return self.fds.take_missing()

    def open_count(self) -> int:
        return self.fds.open_count()

    def create(self, seg: int, slot_bytes: int, nslots: int) -> None:
        """An empty segment file (0600, O_EXCL: a planted name is removed, never opened), its name
        made durable (directory fsync) before the index can refer to it. It grows slot by slot as
        slots are written (never sparse-huge, so copying the directory costs only its real size)."""
        path = self.path(seg, slot_bytes)
        try:
            fd = cachedir.open_file(path, os.O_RDWR, create=True)
        except FileExistsError:
            # An orphan of a rolled-back allocation (no index row names it) is empty: removed.
            # One holding data is never deleted on the word of an index that does not name it
            # (the open-time check rebuilds an index that misses a slab with data): kept aside.
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_size > 0:
                aside = f"{path}.orphan-{time.time_ns()}"
                log.error("%s holds data but no segment names it: kept as %s", path, aside)
                os.replace(path, aside)
            else:
                log.warning("%s exists but no segment names it: replaced", path)
                os.unlink(path)
            fd = cachedir.open_file(path, os.O_RDWR, create=True)
        os.close(fd)
        cachedir.fsync_dir(self.directory)

    def sync(self, seg: int, slot_bytes: int) -> bool:
        try:
            with self.use(seg, slot_bytes) as fd:
                os.fdatasync(fd)
                if os.fstat(fd).st_nlink == 0:  # deleted under us: the blocks would be lost
                    self.fds.mark_missing(seg, slot_bytes)
                    return False
            if self.cache is not None:          # drops this sync's pages held: again now
                self.cache.retry()
            return True
        except OSError as e:
            log.warning("fdatasync of segment %d failed: %s", seg, e)
            return False

    def free(self, seg: int, slot_bytes: int, slot: int) -> None:
        """Release a slot's disk space; its header no longer names a block either way (a punched
        hole reads as zeros; without hole punching the header is zeroed), so no index rebuild
        brings a deleted block back. Out of fds (EMFILE/ENFILE), the idle cached fds are closed
        and it is tried once more. Raises OSError if the header may still name the block (the
        index keeps the slot as a tombstone); a slab that is gone holds nothing to free."""
        for attempt in (1, 2):
            try:
                with self.use(seg, slot_bytes) as fd:
                    if not punch_hole(fd, slot * slot_bytes, slot_bytes):
                        os.pwrite(fd, _zeros(), slot * slot_bytes)
                return
            except SlabMissing:
                return
            except OSError as e:
                if attempt == 1 and e.errno in (errno.EMFILE, errno.ENFILE):
                    self.fds.close()   # drops idle cached fds (reopened on next use)
                    continue
                raise

    def write_block(self, seg: int, slot_bytes: int, slot: int, key: bytes,
                    bufs: Sequence[Buffer], length: int, csum: int,
                    created_ns: int) -> WriteOutcome:
        """Write one block into its slot: `WRITTEN`, else failed with the reason."""
        try:
            with self.use(seg, slot_bytes, self.cache is not None) as fd:
                done = self._write(fd, slot * slot_bytes, key, bufs, length, csum, created_ns)
        except OSError as e:
            return write_error(e)
        if done.ok:
            self.kept(seg, slot_bytes, slot, length)
        return done

    def _write(self, fd: int, off: int, key: bytes, bufs: Sequence[Buffer], length: int, csum: int,
               created_ns: int) -> WriteOutcome:
        # No fallocate first: it costs ~20% of a 2 MiB write; the file system allocates the
        # slot's blocks as the O_DIRECT write lands, and ENOSPC surfaces from the write.
        hdr = self.headers.write(1)[0]
        pack_header_into(hdr, key, length, csum, created_ns)
        if aligned(bufs) and len(bufs) < IOV_MAX:
            iov: list[Buffer] = [hdr, *bufs]
            want = HEADER_BYTES + length
        else:
            size = align_up(length)
            bounce = self.headers.bounce_of(size)
            pos = 0
            for b in bufs:
                mv = memoryview(b).cast("B")
                bounce[pos:pos + mv.nbytes] = mv
                pos += mv.nbytes
            if size > length:
                bounce[length:size] = bytes(size - length)
            iov = [hdr, memoryview(bounce)[:size]]
            want = HEADER_BYTES + size
        n = self.write_pieces(fd, iov, off)
        return WRITTEN if n == want else write_failed(f"short write ({n} of {want} bytes)")

    def write_pieces(self, fd: int, iov: Sequence[Buffer], off: int,
                     piece: int = WRITE_PIECE_BYTES) -> int:
        """`pwritev(fd, iov, off)` as calls of at most `piece` bytes (buffers cut at multiples of
        `piece`, a multiple of 4 KiB: O_DIRECT alignment kept), each through the gate. Returns the
        bytes written, as one `pwritev` would: less than asked when a call came back short or
        failed after others wrote (ENOSPC partway: the slots written whole are kept); an error
        of the first call is raised."""
        done = 0
        for part in cut(iov, piece):
            want = sum(memoryview(b).nbytes for b in part)
            try:
                with self.gate.writing(want):
                    n = os.pwritev(fd, part, off + done)
            except OSError:
                if not done:
                    raise
                break
            done += n
            if n != want:
                break
        return done

    def read_block(self, seg: int, slot_bytes: int, slot: int, key: bytes, length: int,
                   csum: int, dests: Sequence[Buffer], buffered: bool = False) -> ReadOutcome:
        """Read and verify one block into `dests` (`ReadOutcome`: corrupt means the stored block
        is bad, or its slot was reused under the read). `buffered`: from the page cache (a slot
        `cached_slot` found whole), past the gate; verified the same way."""
        hdr = self.headers.read(1)[0]
        gate = contextlib.nullcontext if buffered else self.gate.reading
        try:
            with self.use(seg, slot_bytes, buffered) as fd:
                off = slot * slot_bytes
                if aligned(dests) and len(dests) < IOV_MAX:
                    with gate():
                        n = os.preadv(fd, [hdr, *dests], off)
                    if n != HEADER_BYTES + length:
                        return corrupt(f"short read ({n} of {HEADER_BYTES + length} bytes)")
                    data: Sequence[Buffer] = dests
                    copy_from = None
                else:
                    size = align_up(length)
                    bounce = self.headers.bounce_of(size)
                    with gate():
                        n = os.preadv(fd, [hdr, memoryview(bounce)[:size]], off)
                    if n != HEADER_BYTES + size:
                        return corrupt(f"short read ({n} of {HEADER_BYTES + size} bytes)")
                    copy_from = memoryview(bounce)[:length]
                    data = [copy_from]
        except OSError as e:
            return read_error(e)
        except (OverflowError, ValueError) as e:  # an offset no file has: a damaged location
            return corrupt(f"bad location ({e})")
        got = verify(hdr, key, length, csum, data)
        if not got.ok:
            return got
        if copy_from is not None:
            pos = 0
            for b in dests:
                mv = memoryview(b).cast("B")
                mv[:] = copy_from[pos:pos + mv.nbytes]
                pos += mv.nbytes
        if buffered:
            self.kept(seg, slot_bytes, slot, length)
            return READ_CACHED
        return READ_OK

    def allocated_slots(self, seg: int, slot_bytes: int, nslots: int) -> set[int]:
        """Slots holding data (SEEK_DATA/SEEK_HOLE), so a rebuild skips the sparse rest."""
        end = nslots * slot_bytes
        out: set[int] = set()
        pos = 0
        with self.use(seg, slot_bytes) as fd:
            try:
                while pos < end:
                    try:
                        start = os.lseek(fd, pos, os.SEEK_DATA)
                    except OSError as e:
                        if e.errno == errno.ENXIO:  # no data past pos
                            break
                        raise
                    stop = min(os.lseek(fd, start, os.SEEK_HOLE), end)
                    out.update(range(start // slot_bytes, (stop + slot_bytes - 1) // slot_bytes))
                    pos = max(stop, start + 1)
            except OSError:  # no SEEK_DATA support: every slot may hold data
                return set(range(nslots))
        return {s for s in out if s < nslots}

    def write_header(self, seg: int, slot_bytes: int, slot: int, key: bytes, length: int,
                     csum: int, created_ns: int, kind: int) -> WriteOutcome:
        """Write only a slot's header (its data was written by another path, e.g. GDS)."""
        try:
            with self.use(seg, slot_bytes) as fd:
                hdr = self.headers.write(1)[0]
                pack_header_into(hdr, key, length, csum, created_ns, kind)
                with self.gate.writing(HEADER_BYTES):
                    n = os.pwritev(fd, [hdr], slot * slot_bytes)
            return WRITTEN if n == HEADER_BYTES else write_failed(f"short header write ({n} bytes)")
        except OSError as e:
            return write_error(e)

    def reserve_space(self, seg: int, slot_bytes: int, slot: int) -> WriteOutcome:
        """Allocate a slot's blocks on the file system (the slot path, before another path writes
        its data): `WRITTEN`, else failed with the reason."""
        try:
            with self.use(seg, slot_bytes) as fd:
                os.posix_fallocate(fd, slot * slot_bytes, slot_bytes)
            return WRITTEN
        except OSError as e:
            return write_error(e)

    def read_header(self, seg: int, slot_bytes: int, slot: int,
                    errors: bool = False) -> Header | None:
        """A slot's header (None: short or invalid; an I/O error too, unless `errors`: raised)."""
        hdr = self.headers.read(1)[0]
        try:
            with self.use(seg, slot_bytes) as fd:
                with self.gate.reading():
                    n = os.preadv(fd, [hdr], slot * slot_bytes)
                if n != HEADER_BYTES:
                    return None
        except OSError:
            if errors:
                raise
            return None
        return unpack_header(hdr)

    def close(self) -> None:
        self.fds.close()


__all__ = ["IOV_MAX", "MAX_OPEN", "MISSING", "WRITE_PIECE_BYTES", "HeaderAreas", "SlabFiles",
           "SlabMissing", "aligned", "cut", "punch_hole", "read_error", "reason", "write_error"]
