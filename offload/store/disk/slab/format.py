"""The on-disk format of a slab slot: names, alignment, checksums and the 4 KiB slot header.

A slab (segment) file `seg-<id>-<slot_bytes>.slab` holds equal, 4 KiB-aligned slots. A slot is a
4 KiB header followed by the block's data padded to 4 KiB. The header: magic, version, checksum
kind, the block's 32-byte key, length, the data's checksum, creation time (unix ns), then an
xxh3-64 of those fields. No I/O here (that is `files.py`).

Primitives: `segment_name` / `parse_segment_name`, `checksum` (xxh3-64,
blocks written from host memory) / `wsum64` (the GDS path's checksum) / `checksum_of(kind)`,
`pack_header` / `pack_header_into` / `unpack_header` -> `Header`, `verify(header, ...)` -> a
`ReadOutcome` (typed: ok / corrupt / failed, with its reason); a write's `WriteOutcome` (written /
failed, with its reason).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal, Sequence

from offload.store.base import Buffer
from offload.store.checksum import CSUM_WSUM64 as CSUM_WSUM64
from offload.store.checksum import CSUM_XXH3 as CSUM_XXH3
from offload.store.checksum import checksum as checksum
from offload.store.checksum import checksum_of as checksum_of
from offload.store.checksum import wsum64 as wsum64
from offload.store.checksum import xxh3_int

# the slot geometry lives in the leaf both halves share (`disk/location.py`); named here too
from offload.store.disk.location import ALIGN as ALIGN
from offload.store.disk.location import HEADER_BYTES as HEADER_BYTES
from offload.store.disk.location import align_up as align_up
from offload.store.disk.location import slot_bytes_for as slot_bytes_for

MAGIC = b"SGLOBLK1"
VERSION = 1
# magic, version, flags, key(32), length, checksum, created (unix ns). flags: checksum kind.
_HDR = struct.Struct("<8sHH32sQQQ")
_HDR_CSUM = struct.Struct("<Q")
HEADER_USED = _HDR.size + _HDR_CSUM.size   # the rest of the 4 KiB header is zero

def segment_name(seg: int, slot_bytes: int) -> str:
    return f"seg-{seg:06d}-{slot_bytes}.slab"


def parse_segment_name(name: str) -> tuple[int, int] | None:
    parts = name[:-5].split("-") if name.endswith(".slab") else []
    if len(parts) == 3 and parts[0] == "seg" and parts[1].isdigit() and parts[2].isdigit():
        return int(parts[1]), int(parts[2])
    return None


def pack_header(key: bytes, length: int, csum: int, created_ns: int,
                kind: int = CSUM_XXH3) -> bytes:
    body = _HDR.pack(MAGIC, VERSION, kind, key, length, csum, created_ns)
    return body + _HDR_CSUM.pack(xxh3_int()(body))


def pack_header_into(dest: memoryview, key: bytes, length: int, csum: int, created_ns: int,
                     kind: int = CSUM_XXH3) -> None:
    """Pack a header at the start of `dest` (a 4 KiB header area whose tail is already zero)."""
    _HDR.pack_into(dest, 0, MAGIC, VERSION, kind, key, length, csum, created_ns)
    _HDR_CSUM.pack_into(dest, _HDR.size, xxh3_int()(dest[:_HDR.size]))


@dataclass(frozen=True)
class Header:
    key: bytes
    length: int
    csum: int
    created_ns: int
    kind: int = CSUM_XXH3


def _fields(raw: Buffer) -> tuple[bytes, int, int, int, int] | None:
    """(key, length, csum, created, kind) of an intact header in `raw`, else None."""
    mv = memoryview(raw)
    if mv.nbytes < HEADER_USED:
        return None
    (stored,) = _HDR_CSUM.unpack_from(mv, _HDR.size)
    if stored != xxh3_int()(mv[:_HDR.size]):
        return None
    magic, version, kind, key, length, csum, created = _HDR.unpack_from(mv, 0)
    if magic != MAGIC or version != VERSION:
        return None
    return key, length, csum, created, kind


def unpack_header(raw: Buffer) -> Header | None:
    """The header in `raw`, or None if it is not a valid, intact header."""
    f = _fields(raw)
    return None if f is None else Header(*f)


@dataclass(frozen=True)
class ReadOutcome:
    """What one block's read came to: `ok` (read and verified), `corrupt` (the stored block is
    bad, or another process reused its slot under the read: the caller tells which), or `failed`
    (an I/O error: a miss, the block kept). `reason` is the text for logs and `cache verify`;
    `cached`: served from the page cache (`pagecache.py`), verified the same way."""
    kind: Literal["ok", "corrupt", "failed"]
    reason: str = ""
    cached: bool = False

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    @property
    def corrupt(self) -> bool:
        return self.kind == "corrupt"


READ_OK = ReadOutcome("ok")
READ_CACHED = ReadOutcome("ok", "page cache", cached=True)


def corrupt(why: str) -> ReadOutcome:
    return ReadOutcome("corrupt", f"corrupt: {why}")


def read_failed(why: str) -> ReadOutcome:
    return ReadOutcome("failed", why)


@dataclass(frozen=True)
class WriteOutcome:
    """What one block's write came to, as `ReadOutcome` says for a read: `written` (its bytes are
    in the slot, and durable once the caller synced them) or `failed` (not stored: an I/O error,
    a short write, a full disk, a failed sync; the caller frees the slot). `reason` is the text
    for logs."""
    kind: Literal["written", "failed"]
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.kind == "written"


WRITTEN = WriteOutcome("written")


def write_failed(why: str) -> WriteOutcome:
    return WriteOutcome("failed", why)


def verify(raw_header: Buffer, key: bytes, length: int, csum: int,
           data: Sequence[Buffer]) -> ReadOutcome:
    """`READ_OK` if the header names this block and the data matches its checksum, else why not."""
    f = _fields(raw_header)
    if f is None:
        return corrupt("bad slot header")
    if f[0] != key or f[1] != length or f[2] != csum:
        return corrupt("slot header does not match the index")
    if checksum_of(f[4], data) != csum:
        return corrupt("checksum mismatch")
    return READ_OK
