"""Raw O_DIRECT sequential bandwidth of a directory's disk: the baseline every bench divides by.

`raw_bandwidth(directory, total_bytes, chunk)` writes a file sequentially with O_DIRECT (then
fdatasync), reads it back with O_DIRECT, deletes it, and returns (write GB/s, read GB/s) — what
`dd oflag=direct` / `iflag=direct` would show. With `streams=N`, N threads share the chunks (queue
depth N, like `fio --numjobs`): the disk's bandwidth when it is kept busy. Falls back to buffered
I/O + fdatasync +
posix_fadvise(DONTNEED) on file systems that refuse O_DIRECT.
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor


def raw_bandwidth(directory: str, total_bytes: int, chunk: int = 16 << 20,
                  streams: int = 1) -> tuple[float, float]:
    path = os.path.join(directory, f".raw-bench.{os.getpid()}")
    buf = mmap.mmap(-1, chunk)
    buf.write(os.urandom(1 << 20) * (chunk >> 20))
    n = max(1, total_bytes // chunk)
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
            direct = True
        except OSError:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            direct = False
        try:
            os.posix_fallocate(fd, 0, n * chunk)
            bufs = [buf] + [mmap.mmap(-1, chunk) for _ in range(streams - 1)]
            with ThreadPoolExecutor(streams) as pool:
                t = time.perf_counter()
                list(pool.map(lambda i: os.pwrite(fd, buf, i * chunk), range(n)))
                os.fdatasync(fd)
                write_s = time.perf_counter() - t
                if not direct:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                t = time.perf_counter()
                list(pool.map(lambda i: os.preadv(fd, [bufs[i % streams]], i * chunk), range(n)))
                read_s = time.perf_counter() - t
            for b in bufs[1:]:
                b.close()
        finally:
            os.close(fd)
    finally:
        buf.close()
        try:
            os.unlink(path)
        except OSError:
            pass
    return n * chunk / write_s / 1e9, n * chunk / read_s / 1e9
