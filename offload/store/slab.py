"""Slab files: the bytes of the disk store. No bookkeeping here (that is `index.py`).

A slab (segment) file `seg-<id>-<slot_bytes>.slab` is a sparse file of equal, 4 KiB-aligned slots.
A slot holds one block: a 4 KiB header (magic, version, key, length, xxh3-64 of the data, header
checksum) followed by the data padded to 4 KiB. Slots are allocated with fallocate when written
and hole-punched when freed, so the disk holds only live blocks. I/O is O_DIRECT where the file
system allows (else buffered, logged once), vectored straight from/into the caller's buffers when
they are aligned, through a per-thread aligned bounce buffer when they are not.

Files are created 0600 with O_EXCL and opened with O_NOFOLLOW (`cachedir.open_file`): a symlink is
refused, never followed. A new slab's name is fsync'ed into the directory before any block in it
is committed. A freed slot's header stops naming its block (hole punched, else zeroed).

Primitives: `SlabFiles` (per-process LRU cache of open segment fds, bounded; segments found missing
are reported through `take_missing`), `pack_header`/`unpack_header`, `write_block`/`read_block`
(called from I/O threads; return a reason string, '' = ok, never raise).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Sequence

from offload.store import cachedir
from offload.store.base import Buffer

log = logging.getLogger(__name__)

ALIGN = 4096
HEADER_BYTES = ALIGN
MAGIC = b"SGLOBLK1"
VERSION = 1
# magic, version, flags, key(32), length, checksum, created (unix ns). flags: checksum kind.
_HDR = struct.Struct("<8sHH32sQQQ")
_HDR_CSUM = struct.Struct("<Q")
IOV_MAX = 1024
MAX_OPEN = 256  # slab fds kept open per process (LRU)


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def slot_bytes_for(length: int) -> int:
    return HEADER_BYTES + align_up(length)


def segment_name(seg: int, slot_bytes: int) -> str:
    return f"seg-{seg:06d}-{slot_bytes}.slab"


def parse_segment_name(name: str) -> tuple[int, int] | None:
    parts = name[:-5].split("-") if name.endswith(".slab") else []
    if len(parts) == 3 and parts[0] == "seg" and parts[1].isdigit() and parts[2].isdigit():
        return int(parts[1]), int(parts[2])
    return None


def _xxh3():  # type: ignore[no-untyped-def]
    import xxhash

    return xxhash.xxh3_64


CSUM_XXH3 = 0    # xxh3-64 of the data: every block written from host memory
CSUM_WSUM64 = 1  # position-weighted 64-bit word sum: blocks written by GDS (computed on the GPU)


def checksum(buffers: Sequence[Buffer]) -> int:
    h = _xxh3()()
    for b in buffers:
        h.update(b)
    return h.intdigest()


def wsum64(buffers: Sequence[Buffer]) -> int:
    """The GDS path's checksum, on the CPU: sum of little-endian 64-bit words times odd position
    weights (1, 3, 5, ...) mod 2^64, xor the length (zero padding to a whole word)."""
    import numpy as np

    raw = np.frombuffer(b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
                        if len(buffers) != 1 else memoryview(buffers[0]).cast("B"), dtype=np.uint8)
    n = raw.size
    if n % 8:
        raw = np.concatenate([raw, np.zeros(8 - n % 8, np.uint8)])
    words = raw.view("<u8")
    weights = np.arange(words.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    with np.errstate(over="ignore"):
        s = int((words * weights).sum(dtype=np.uint64))
    return s ^ n


def checksum_of(kind: int, buffers: Sequence[Buffer]) -> int | None:
    if kind == CSUM_XXH3:
        return checksum(buffers)
    if kind == CSUM_WSUM64:
        return wsum64(buffers)
    return None


def pack_header(key: bytes, length: int, csum: int, created_ns: int,
                kind: int = CSUM_XXH3) -> bytes:
    body = _HDR.pack(MAGIC, VERSION, kind, key, length, csum, created_ns)
    return body + _HDR_CSUM.pack(_xxh3()(body).intdigest())


@dataclass(frozen=True)
class Header:
    key: bytes
    length: int
    csum: int
    created_ns: int
    kind: int = CSUM_XXH3


def unpack_header(raw: Buffer) -> Header | None:
    """The header in `raw`, or None if it is not a valid, intact header."""
    mv = memoryview(raw)
    if mv.nbytes < _HDR.size + _HDR_CSUM.size:
        return None
    body = bytes(mv[:_HDR.size])
    (stored,) = _HDR_CSUM.unpack_from(mv, _HDR.size)
    if stored != _xxh3()(body).intdigest():
        return None
    magic, version, kind, key, length, csum, created = _HDR.unpack(body)
    if magic != MAGIC or version != VERSION:
        return None
    return Header(key, length, csum, created, kind)


def verify(raw_header: Buffer, key: bytes, length: int, csum: int, data: Sequence[Buffer]) -> str:
    """'' if the header names this block and the data matches its checksum, else why not."""
    h = unpack_header(raw_header)
    if h is None:
        return "corrupt: bad slot header"
    if h.key != key or h.length != length or h.csum != csum:
        return "corrupt: slot header does not match the index"
    if checksum_of(h.kind, data) != csum:
        return "corrupt: checksum mismatch"
    return ""


def address(buf: Buffer) -> int:
    import numpy as np

    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def _aligned(bufs: Sequence[Buffer]) -> bool:
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


class _ThreadBuffers(threading.local):
    def __init__(self) -> None:
        self.header = mmap.mmap(-1, HEADER_BYTES)
        self.bounce: mmap.mmap | None = None

    def bounce_of(self, size: int) -> mmap.mmap:
        if self.bounce is None or len(self.bounce) < size:
            if self.bounce is not None:
                self.bounce.close()
            self.bounce = mmap.mmap(-1, align_up(size, 1 << 20))
        return self.bounce


class SlabMissing(FileNotFoundError):
    """A segment's slab file is gone (deleted, or lost in a power cut before it was durable)."""


MISSING = "corrupt: slab file missing"


def reason(e: OSError, prefix: str = "") -> str:
    """The per-block reason for an I/O error ('corrupt: ...' when the slab file is missing)."""
    if isinstance(e, SlabMissing):
        return MISSING
    return f"{prefix}{errno.errorcode.get(e.errno or 0, e.errno)}: {e.strerror}"


class _Fd:
    __slots__ = ("fd", "refs", "evicted")

    def __init__(self, fd: int):
        self.fd, self.refs, self.evicted = fd, 0, False


_zero_header: mmap.mmap | None = None


def _zeros() -> mmap.mmap:
    global _zero_header
    if _zero_header is None:
        _zero_header = mmap.mmap(-1, HEADER_BYTES)  # aligned, all zero: an O_DIRECT source
    return _zero_header


class SlabFiles:
    """Open segment files of one directory, shared by the threads of one process.

    At most `max_open` fds stay open (least recently used closed first); an fd in use by a thread
    is closed only once that thread is done with it. Segments found missing are remembered
    (`take_missing`) so the store drops them from its index.
    """

    def __init__(self, directory: str, o_direct: str, max_open: int = MAX_OPEN):
        self.directory = directory
        self.o_direct = o_direct  # "on" | "off" | "auto"
        self.direct_ok: bool | None = None if o_direct == "auto" else o_direct == "on"
        self.fallback_reason = ""
        self.max_open = max(1, max_open)
        self._fds: OrderedDict[tuple[int, int], _Fd] = OrderedDict()  # (seg, slot_bytes) -> fd
        self._missing: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self._tls = _ThreadBuffers()

    def path(self, seg: int, slot_bytes: int) -> str:
        return os.path.join(self.directory, segment_name(seg, slot_bytes))

    def create(self, seg: int, slot_bytes: int, nslots: int) -> None:
        """An empty segment file (0600, O_EXCL: a planted name is removed, never opened), its name
        made durable (directory fsync) before the index can refer to it. It grows slot by slot as
        slots are written (never sparse-huge, so copying the directory costs only its real size)."""
        path = self.path(seg, slot_bytes)
        try:
            fd = cachedir.open_file(path, os.O_RDWR, create=True)
        except FileExistsError:  # an orphan of a rolled-back allocation (no index row names it)
            log.warning("%s exists but no segment names it: replaced", path)
            os.unlink(path)
            fd = cachedir.open_file(path, os.O_RDWR, create=True)
        os.close(fd)
        cachedir.fsync_dir(self.directory)

    def _open(self, seg: int, slot_bytes: int) -> int:
        path = self.path(seg, slot_bytes)
        try:
            if self.direct_ok is not False:
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
            self._missing.add((seg, slot_bytes))
            raise SlabMissing(errno.ENOENT, "slab file missing", path) from None

    @contextlib.contextmanager
    def use(self, seg: int, slot_bytes: int) -> Iterator[int]:
        """The segment's fd, held open until the block leaves."""
        k = (seg, slot_bytes)
        with self._lock:
            ent = self._fds.get(k)
            if ent is None:
                ent = self._fds[k] = _Fd(self._open(seg, slot_bytes))
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
            old = self._fds.pop((seg, slot_bytes), None)
            if old is not None:
                old.evicted = True
                if old.refs == 0:
                    os.close(old.fd)

    def take_missing(self) -> set[tuple[int, int]]:
        """Segments found missing since the last call."""
        with self._lock:
            got, self._missing = self._missing, set()
        return got

    def open_count(self) -> int:
        with self._lock:
            return sum(not e.evicted for e in self._fds.values())

    def sync(self, seg: int, slot_bytes: int) -> bool:
        try:
            with self.use(seg, slot_bytes) as fd:
                os.fdatasync(fd)
                if os.fstat(fd).st_nlink == 0:  # deleted under us: the blocks would be lost
                    with self._lock:
                        self._missing.add((seg, slot_bytes))
                    return False
            return True
        except OSError as e:
            log.warning("fdatasync of segment %d failed: %s", seg, e)
            return False

    def free(self, seg: int, slot_bytes: int, slot: int) -> None:
        """Release a slot's disk space; its header no longer names a block either way (a punched
        hole reads as zeros; without hole punching the header is zeroed), so no index rebuild
        brings a deleted block back."""
        try:
            with self.use(seg, slot_bytes) as fd:
                if not punch_hole(fd, slot * slot_bytes, slot_bytes):
                    os.pwrite(fd, _zeros(), slot * slot_bytes)
        except OSError as e:
            log.debug("freeing slot %d of segment %d: %s", slot, seg, e)

    def write_block(self, seg: int, slot_bytes: int, slot: int, key: bytes,
                    bufs: Sequence[Buffer], length: int, csum: int, created_ns: int) -> str:
        """Write one block into its slot. Returns '' on success, else the reason."""
        try:
            with self.use(seg, slot_bytes) as fd:
                return self._write(fd, slot * slot_bytes, key, bufs, length, csum, created_ns)
        except OSError as e:
            return reason(e)

    def _write(self, fd: int, off: int, key: bytes, bufs: Sequence[Buffer], length: int, csum: int,
               created_ns: int) -> str:
        # No fallocate first: it costs ~20% of a 2 MiB write; the file system allocates the
        # slot's blocks as the O_DIRECT write lands, and ENOSPC surfaces from the write.
        hdr = self._tls.header
        hdr.seek(0)
        hdr.write(pack_header(key, length, csum, created_ns).ljust(HEADER_BYTES, b"\0"))
        if _aligned(bufs) and len(bufs) < IOV_MAX:
            iov: list[Buffer] = [hdr, *bufs]
            want = HEADER_BYTES + length
        else:
            size = align_up(length)
            bounce = self._tls.bounce_of(size)
            pos = 0
            for b in bufs:
                mv = memoryview(b).cast("B")
                bounce[pos:pos + mv.nbytes] = mv
                pos += mv.nbytes
            if size > length:
                bounce[length:size] = bytes(size - length)
            iov = [hdr, memoryview(bounce)[:size]]
            want = HEADER_BYTES + size
        n = os.pwritev(fd, iov, off)
        return "" if n == want else f"short write ({n} of {want} bytes)"

    def read_block(self, seg: int, slot_bytes: int, slot: int, key: bytes, length: int,
                   csum: int, dests: Sequence[Buffer]) -> str:
        """Read and verify one block into `dests`. Returns '' if verified, else the reason.

        A reason starting with 'corrupt' means the stored block is bad (to be deleted).
        """
        hdr = self._tls.header
        try:
            with self.use(seg, slot_bytes) as fd:
                off = slot * slot_bytes
                if _aligned(dests) and len(dests) < IOV_MAX:
                    n = os.preadv(fd, [hdr, *dests], off)
                    if n != HEADER_BYTES + length:
                        return f"corrupt: short read ({n} of {HEADER_BYTES + length} bytes)"
                    data: Sequence[Buffer] = dests
                    copy_from = None
                else:
                    size = align_up(length)
                    bounce = self._tls.bounce_of(size)
                    n = os.preadv(fd, [hdr, memoryview(bounce)[:size]], off)
                    if n != HEADER_BYTES + size:
                        return f"corrupt: short read ({n} of {HEADER_BYTES + size} bytes)"
                    copy_from = memoryview(bounce)[:length]
                    data = [copy_from]
        except OSError as e:
            return reason(e, "io error ")
        err = verify(hdr, key, length, csum, data)
        if err:
            return err
        if copy_from is not None:
            pos = 0
            for b in dests:
                mv = memoryview(b).cast("B")
                mv[:] = copy_from[pos:pos + mv.nbytes]
                pos += mv.nbytes
        return ""

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
                     csum: int, created_ns: int, kind: int) -> str:
        """Write only a slot's header (its data was written by another path, e.g. GDS)."""
        try:
            with self.use(seg, slot_bytes) as fd:
                hdr = self._tls.header
                hdr.seek(0)
                hdr.write(pack_header(key, length, csum, created_ns, kind).ljust(HEADER_BYTES, b"\0"))
                n = os.pwritev(fd, [hdr], slot * slot_bytes)
            return "" if n == HEADER_BYTES else f"short header write ({n} bytes)"
        except OSError as e:
            return reason(e)

    def reserve_space(self, seg: int, slot_bytes: int, slot: int) -> str:
        try:
            with self.use(seg, slot_bytes) as fd:
                os.posix_fallocate(fd, slot * slot_bytes, slot_bytes)
            return ""
        except OSError as e:
            return reason(e)

    def read_header(self, seg: int, slot_bytes: int, slot: int) -> Header | None:
        hdr = self._tls.header
        try:
            with self.use(seg, slot_bytes) as fd:
                if os.preadv(fd, [hdr], slot * slot_bytes) != HEADER_BYTES:
                    return None
        except OSError:
            return None
        return unpack_header(hdr)

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
