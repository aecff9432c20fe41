"""A batch's slab I/O: consecutive slots of one segment moved with one pwritev / preadv.

A batch of puts usually gets consecutive slots, and a batch of gets of one prefix usually reads
them back in order. Writing eight 2 MiB slots as one 16 MiB vectored call (header, data, header,
data, ...) instead of eight calls keeps the device at its sequential bandwidth; small blocks are
grouped into runs of at least `MIN_RUN_BYTES` even when that leaves some I/O threads idle (a
256 KiB call costs about what a 2 MiB one does). A run is used only when every buffer is 4 KiB
aligned and every block fills its slot exactly (no padding, no bounce); anything else goes block
by block through `SlabFiles.write_block` / `read_block`.

Primitives: `write_batch` (the caller's thread checksums each run and hands it to the I/O threads,
which write it while the next run is checksummed; then one fdatasync per touched slab, or none:
the group committer syncs), `sync_segments`, and `read_batch` (read + verify on the I/O threads):
one result per block, never raising; built on `plan_runs(locations)` -> lists of locations to
move together, `ramp` (the first run of a write cut into growing pieces) and `write_run` /
`read_run`. A batch that is a single run (a single piece, for writes) runs in the caller's thread
(no hand-off). With a page-cache budget (`pagecache.py`), `read_batch` first asks which blocks
the kernel holds whole: those are read through the buffered fd (a block that fails its checks
there is read again with O_DIRECT, so only verified bytes are ever served), the rest as before.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import Executor, Future, wait
from typing import Callable, Sequence, TypeVar

from offload.store.base import Buffer
from offload.store.disk.location import Location
from offload.store.disk.slab import files as slab
from offload.store.disk.slab import format as slot_format
from offload.store.disk.slab.format import WRITTEN, ReadOutcome, WriteOutcome, write_failed

RUN_BYTES = 16 << 20      # about where a single stream reaches the device's sequential bandwidth
MIN_RUN_BYTES = 4 << 20   # smaller runs cost per-call overhead (syscall, thread hand-off) per byte
RAMP_BYTES = 512 << 10    # a write batch's first piece: the checksum the device waits for

T = TypeVar("T")
R = TypeVar("R")


def _map(pool: Executor, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """fn over items on the pool; a single item in the calling thread."""
    if len(items) == 1:
        return [fn(items[0])]
    return list(pool.map(fn, items))


def plan_runs(locs: Sequence[Location], bufs: Sequence[Sequence[Buffer]],
              threads: int = 1) -> list[list[int]]:
    """Indices of `locs` grouped into runs of consecutive, exactly-filled, aligned slots.

    A run holds at most RUN_BYTES. The batch is cut into as many runs as it has MIN_RUN_BYTES
    (at least one, at most `threads`, so the I/O threads and the device queue are kept busy but
    small blocks still move in large calls), each of an even share of the blocks.
    """
    total = sum(loc.slot_bytes for loc in locs)
    nruns = max(1, min(max(1, threads), total // MIN_RUN_BYTES))
    share = -(-len(locs) // nruns)
    runs: list[list[int]] = []
    joinable = False  # whether the last run may grow
    nbuf = size = 0
    for i in sorted(range(len(locs)), key=lambda i: (locs[i].seg, locs[i].slot)):
        loc = locs[i]
        fits = loc.length + slot_format.HEADER_BYTES == loc.slot_bytes and slab.aligned(bufs[i])
        if fits and joinable:
            prev = locs[runs[-1][-1]]
            if (prev.seg == loc.seg and prev.slot + 1 == loc.slot
                    and len(runs[-1]) < share and size + loc.slot_bytes <= RUN_BYTES
                    and nbuf + 1 + len(bufs[i]) < slab.IOV_MAX):
                runs[-1].append(i)
                nbuf += 1 + len(bufs[i])
                size += loc.slot_bytes
                continue
        runs.append([i])
        joinable, nbuf, size = fits, 1 + len(bufs[i]), loc.slot_bytes
    return runs


def write_batch(slabs: slab.SlabFiles, pool: Executor, locs: Sequence[Location],
                bufs: Sequence[Sequence[Buffer]], created_ns: int,
                threads: int, sync: bool = True) -> list[tuple[WriteOutcome, int]]:
    """Checksum and write every block (header and data in one vectored call per run), then
    (`sync`) fdatasync each touched slab once. Per block: (its `WriteOutcome`: written, and
    durable when `sync`, else failed with why; its checksum).

    Pipelined: this thread checksums the runs in order and hands each to the I/O threads as soon
    as its checksums are known, so run k is written while run k+1 is checksummed; the first run
    is cut short (`RAMP_BYTES`) so the device starts after a short checksum, not a whole run's."""

    def write(run: list[int], csums: list[int]) -> list[tuple[WriteOutcome, int]]:
        ls = [locs[i] for i in run]
        if len(run) > 1:
            done = write_run(slabs, ls, [bufs[i] for i in run], csums, created_ns)
        else:
            loc = ls[0]
            done = [slabs.write_block(loc.seg, loc.slot_bytes, loc.slot, loc.key, bufs[run[0]],
                                      loc.length, csums[0], created_ns)]
        return list(zip(done, csums))

    plan = ramp(plan_runs(locs, bufs, threads), locs)
    out: list[tuple[WriteOutcome, int]] = [(WRITTEN, 0)] * len(locs)
    futs: list[tuple[list[int], Future[list[tuple[WriteOutcome, int]]]]] = []
    try:
        for run in plan:
            csums = [slot_format.checksum(bufs[i]) for i in run]
            if len(plan) == 1:   # no hand-off
                for i, r in zip(run, write(run, csums)):
                    out[i] = r
            else:
                futs.append((run, pool.submit(write, run, csums)))
    except Exception as e:   # a checksum or the hand-off failed: the rest is not written
        why = write_failed(f"not written: {type(e).__name__}: {e}")
        for run in plan[len(futs):]:
            for i in run:
                out[i] = (why, 0)
    wait([f for _, f in futs])   # never return while a thread still reads the caller's buffers
    for run, f in futs:
        try:
            res = f.result()
        except Exception as e:   # (write_run / write_block return OSErrors as reasons)
            res = [(write_failed(f"not written: {type(e).__name__}: {e}"), 0)] * len(run)
        for i, r in zip(run, res):
            out[i] = r
    if not sync:
        return out
    synced = sync_segments(slabs, pool,
                           [(loc.seg, loc.slot_bytes) for loc, (w, _) in zip(locs, out) if w.ok])
    return [(w if not w.ok or synced[(loc.seg, loc.slot_bytes)] else write_failed("fdatasync failed"),
             csum) for loc, (w, csum) in zip(locs, out)]


def ramp(plan: list[list[int]], locs: Sequence[Location]) -> list[list[int]]:
    """The plan with its first run cut into growing pieces (about `RAMP_BYTES`, then twice
    that, ...): the device waits only for the first piece's checksum, and each later piece is
    checksummed while the one before it is written (checksums run several times faster)."""
    if not plan or len(plan[0]) < 2:
        return plan
    pieces: list[list[int]] = [[]]
    size, want = 0, RAMP_BYTES
    for i in plan[0]:
        if size >= want:
            pieces.append([])
            size, want = 0, want * 2
        pieces[-1].append(i)
        size += locs[i].slot_bytes
    return pieces + plan[1:]


def sync_segments(slabs: slab.SlabFiles, pool: Executor,
                  segs: Sequence[tuple[int, int]]) -> dict[tuple[int, int], bool]:
    """fdatasync each (seg, slot_bytes) once, on the I/O threads: whether it is durable."""
    todo = sorted(set(segs))
    return dict(zip(todo, _map(pool, lambda sg: slabs.sync(*sg), todo)))


def read_batch(slabs: slab.SlabFiles, pool: Executor, locs: Sequence[Location],
               dests: Sequence[Sequence[Buffer]], threads: int) -> list[ReadOutcome]:
    """Read and verify every block into its destination: one `ReadOutcome` per block."""

    def read(run: list[int], buffered: bool = False) -> list[ReadOutcome]:
        if len(run) > 1:
            return read_run(slabs, [locs[i] for i in run], [dests[i] for i in run], buffered)
        loc = locs[run[0]]
        return [slabs.read_block(loc.seg, loc.slot_bytes, loc.slot, loc.key, loc.length,
                                 loc.csum, dests[run[0]], buffered)]

    out = [slot_format.READ_OK] * len(locs)
    todo = list(range(len(locs)))
    if slabs.cache is not None:   # what the kernel holds whole: read buffered, no device I/O
        hot = [i for i in todo
               if slabs.cached_slot(locs[i].seg, locs[i].slot_bytes, locs[i].slot, locs[i].length)]
        if hot:
            hot_plan = _sub_runs(locs, dests, hot, threads)
            for run, res in zip(hot_plan, _map(pool, lambda r: read(r, True), hot_plan)):
                for i, got in zip(run, res):
                    out[i] = got
            # a block that failed there (changed under the read, or damaged in the cache) is
            # read again from the device: a miss or a re-read, never unverified bytes
            todo = [i for i in todo if not out[i].ok or not out[i].cached]
    plan = _sub_runs(locs, dests, todo, threads)
    for run, res in zip(plan, _map(pool, read, plan)):
        for i, got in zip(run, res):
            out[i] = got
    return out


def _sub_runs(locs: Sequence[Location], dests: Sequence[Sequence[Buffer]], which: list[int],
              threads: int) -> list[list[int]]:
    """`plan_runs` over the blocks `which` (indices into `locs`)."""
    if not which:
        return []
    plan = plan_runs([locs[i] for i in which], [dests[i] for i in which], threads)
    return [[which[j] for j in run] for run in plan]


def write_run(slabs: slab.SlabFiles, locs: Sequence[Location], bufs: Sequence[Sequence[Buffer]],
              csums: Sequence[int], created_ns: int) -> list[WriteOutcome]:
    """Write consecutive slots in one call. One `WriteOutcome` per block."""
    first = locs[0]
    iov: list[Buffer] = []
    for hdr, loc, b, c in zip(slabs.headers.write(len(locs)), locs, bufs, csums):
        slot_format.pack_header_into(hdr, loc.key, loc.length, c, created_ns)
        iov.append(hdr)
        iov.extend(b)
    want = len(locs) * first.slot_bytes
    try:
        with slabs.use(first.seg, first.slot_bytes, slabs.cache is not None) as fd:
            n = slabs.write_pieces(fd, iov, first.slot * first.slot_bytes)
    except OSError as e:
        return [slab.write_error(e)] * len(locs)
    whole = n // first.slot_bytes  # the slots fully written before a short write stopped
    for loc in locs[:whole]:
        slabs.kept(loc.seg, loc.slot_bytes, loc.slot, loc.length)
    if n == want:
        return [WRITTEN] * len(locs)
    short = write_failed(f"short write ({n} of {want} bytes)")
    return [WRITTEN if j < whole else short for j in range(len(locs))]


def read_run(slabs: slab.SlabFiles, locs: Sequence[Location],
             dests: Sequence[Sequence[Buffer]], buffered: bool = False) -> list[ReadOutcome]:
    """Read consecutive slots in one call, then verify each block. One outcome per block
    (`buffered`: from the page cache, past the gate)."""
    first = locs[0]
    hdrs = slabs.headers.read(len(locs))
    iov: list[Buffer] = []
    for hdr, d in zip(hdrs, dests):
        iov.append(hdr)
        iov.extend(d)
    gate = contextlib.nullcontext() if buffered else slabs.gate.reading()
    try:
        with slabs.use(first.seg, first.slot_bytes, buffered) as fd, gate:
            n = os.preadv(fd, iov, first.slot * first.slot_bytes)
    except OSError as e:
        return [slab.read_error(e)] * len(locs)
    out = []
    for j, (hdr, loc, d) in enumerate(zip(hdrs, locs, dests)):
        if n < (j + 1) * first.slot_bytes:
            out.append(slot_format.corrupt(f"short read ({n} bytes for {len(locs)} slots)"))
            continue
        got = slot_format.verify(hdr, loc.key, loc.length, loc.csum, d)
        if got.ok and buffered:
            slabs.kept(loc.seg, loc.slot_bytes, loc.slot, loc.length)
            got = slot_format.READ_CACHED
        out.append(got)
    return out
