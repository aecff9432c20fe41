"""`detect --probe-io`: a few seconds of O_DIRECT write then read in the cache directory.

Primitives: `probe_io(path, seconds=2.0, max_bytes=1 GiB, chunk=4 MiB) -> IoProbe` (GB/s = 1e9
bytes/s); `probe_io_many(paths, seconds)`: one probe per path (one directory per distinct device,
drive_set.one_per_device), all at once in threads (the I/O calls release the GIL), whose write
and read rates add up: the store's combined figure, each directory's in the reason.
Buffers come from an anonymous mmap (page aligned, as O_DIRECT needs). Where O_DIRECT
is refused (tmpfs, overlayfs) it falls back to buffered I/O, says so, and drops the page cache for
the file (fsync + POSIX_FADV_DONTNEED) before reading. The file is always removed. Never raises.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from offload.hw.facts import IoProbe


def probe_io(path: str, seconds: float = 2.0, max_bytes: int = 1 << 30,
             chunk: int = 4 << 20) -> IoProbe:
    if not os.path.isdir(path):
        return IoProbe(path=path, bytes=0, write_gbps=None, read_gbps=None, o_direct=False,
                       source="O_DIRECT probe", reason=f"{path} does not exist; nothing measured")
    buf = mmap.mmap(-1, chunk)
    buf.write(os.urandom(4096) * (chunk // 4096))
    fd, name = tempfile.mkstemp(prefix=".detect-probe-", dir=path)
    os.close(fd)
    direct = getattr(os, "O_DIRECT", 0)
    try:
        try:
            fd = os.open(name, os.O_WRONLY | direct)
        except OSError:
            direct = 0
            fd = os.open(name, os.O_WRONLY)
        written, t0 = 0, time.perf_counter()
        try:
            while written < max_bytes and time.perf_counter() - t0 < seconds / 2:
                written += os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        wt = time.perf_counter() - t0
        fd = os.open(name, os.O_RDONLY | direct)
        try:
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            read, t0 = 0, time.perf_counter()
            while read < written:
                n = os.readv(fd, [buf])
                if n <= 0:
                    break
                read += n
        finally:
            os.close(fd)
        rt = time.perf_counter() - t0
    except OSError as e:
        return IoProbe(path=path, bytes=0, write_gbps=None, read_gbps=None, o_direct=bool(direct),
                       source="O_DIRECT probe", reason=f"I/O failed in {path}: {e}")
    finally:
        buf.close()
        try:
            os.unlink(name)
        except OSError:
            pass
    w = written / wt / 1e9 if wt > 0 else None
    r = read / rt / 1e9 if rt > 0 and read else None
    mode = "O_DIRECT" if direct else "buffered (O_DIRECT refused; page cache dropped)"
    return IoProbe(path=path, bytes=written, write_gbps=w, read_gbps=r, o_direct=bool(direct),
                   source="O_DIRECT probe",
                   reason=f"{mode}, {written >> 20} MiB in {chunk >> 20} MiB chunks: write "
                          f"{w or 0:.2f} GB/s, read {r or 0:.2f} GB/s")


def probe_io_many(paths: list[str], seconds: float = 2.0, max_bytes: int = 1 << 30) -> IoProbe:
    """`probe_io` in every directory at once; the rates are the sums (None if any is None)."""
    if len(paths) == 1:
        return probe_io(paths[0], seconds, max_bytes)
    with ThreadPoolExecutor(len(paths)) as pool:
        probes = list(pool.map(lambda p: probe_io(p, seconds, max_bytes), paths))

    def total(rates: list[float | None]) -> float | None:
        return None if any(r is None for r in rates) else sum(r or 0.0 for r in rates)

    w, r = total([p.write_gbps for p in probes]), total([p.read_gbps for p in probes])
    each = "; ".join(f"{p.path}: {p.reason}" for p in probes)
    return IoProbe(path=", ".join(paths), bytes=sum(p.bytes for p in probes), write_gbps=w,
                   read_gbps=r, o_direct=all(p.o_direct for p in probes),
                   source="O_DIRECT probe, one per device, at once",
                   reason=f"{len(paths)} devices at once: write {w or 0:.2f} GB/s, read "
                          f"{r or 0:.2f} GB/s combined ({each})")
