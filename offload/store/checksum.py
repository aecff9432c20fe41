"""The per-block checksums every tier keeps: xxh3-64 (blocks written from host memory) and the
GDS path's position-weighted word sum (computed on the GPU, verified here on the CPU).

Primitives: `checksum(buffers)` (xxh3-64, vectored), `wsum64(buffers)`, `checksum_of(kind, buffers)`
with the kinds `CSUM_XXH3` / `CSUM_WSUM64` (the kind is stored in a disk slot's header). xxhash and
numpy are imported on first use (no native module at import).
"""

from __future__ import annotations

from typing import Callable, Sequence

from offload.store.base import Buffer

CSUM_XXH3 = 0    # xxh3-64 of the data: every block written from host memory
CSUM_WSUM64 = 1  # position-weighted 64-bit word sum: blocks written by GDS (computed on the GPU)


_digest: Callable[[Buffer], int] | None = None


def xxh3_int() -> Callable[[Buffer], int]:
    """xxhash's one-shot xxh3-64 (imported on first use: no native module at import)."""
    global _digest
    if _digest is None:
        import xxhash

        _digest = xxhash.xxh3_64_intdigest
    return _digest


def checksum(buffers: Sequence[Buffer]) -> int:
    if len(buffers) == 1:
        return xxh3_int()(buffers[0])
    import xxhash

    h = xxhash.xxh3_64()
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
