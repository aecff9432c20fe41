"""Loads before stores inside the disk store (issue 35): a read returns while a write of the same
store is held mid-call; at the gate, a write waits for the writes in flight while a read is (one
piece moves at a time), never for the read itself; a commit round's flushes wait, bounded, for
the reads in flight; runs and large blocks are written in pieces of at most
`WRITE_PIECE_BYTES`, every byte where it belongs. Real files and threads; a held write is a
gate of the test's own (an `IoGate` whose writes wait on an event). No timing is asserted: the
waits below are liveness bounds (a regression fails instead of hanging)."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from typing import Iterator

from offload.store.disk.slab import files as slab
from offload.store.disk.slab import format as slot_format
from offload.store.disk.slab.gate import IoGate
from tests.store.blocks import data, key
from tests.store.stores import open_store

LIVE_S = 30.0          # liveness bound: only ever reached when the behaviour is broken
PAGE = 2 << 20


def _until(cond, what: str) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + LIVE_S
    while not cond():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.001)


class HeldWrites(IoGate):
    """The production gate, whose write calls (once `hold` is set) wait for `release`."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = threading.Event()
        self.release = threading.Event()
        self.held = 0

    @contextlib.contextmanager
    def writing(self, nbytes: int) -> Iterator[None]:
        with super().writing(nbytes):
            if self.hold.is_set():
                self.held += 1
                self.release.wait(LIVE_S)
            yield


def _pages(ks: list[bytes]) -> tuple[mmap.mmap, list[list[memoryview]]]:
    buf = mmap.mmap(-1, PAGE * len(ks))
    for i, k in enumerate(ks):
        buf[i * PAGE:(i + 1) * PAGE] = data(k, PAGE)
    return buf, [[memoryview(buf)[i * PAGE:(i + 1) * PAGE]] for i in range(len(ks))]


def test_a_read_returns_while_a_write_is_held_mid_call(tmp_path) -> None:
    gate = HeldWrites()
    with open_store(tmp_path, io_threads=2, gate=gate) as s:
        stored = [key(i) for i in range(8)]            # 16 MiB: read in several runs
        src, blocks = _pages(stored)
        assert s.put_many(stored, blocks) == [True] * 8 and s.flush()

        gate.hold.set()                                 # every write call from now on is held
        try:
            new = [key(100 + i) for i in range(8)]
            nsrc, nblocks = _pages(new)
            put: list[list[bool]] = []
            writer = threading.Thread(target=lambda: put.append(s.put_many(new, nblocks)))
            writer.start()
            _until(lambda: gate.held >= 2, "both I/O threads inside a held write")

            dst, outs = _pages([key(-1)] * 8)
            got: list[list[bool]] = []
            reader = threading.Thread(target=lambda: got.append(s.get_many(stored, outs)))
            reader.start()
            reader.join(LIVE_S)
            assert got == [[True] * 8], "the read waited for a held write"
            assert not put and gate.state().write_bytes > 0   # the writes were still held meanwhile
            assert dst[:] == src[:]
        finally:
            gate.release.set()   # (on a failure too: nothing left hanging)
        writer.join(LIVE_S)
        assert put == [[True] * 8] and s.flush()
        dst2, outs2 = _pages([key(-1)] * 8)
        assert s.get_many(new, outs2) == [True] * 8 and dst2[:] == nsrc[:]


def test_while_a_read_is_in_flight_writes_wait_for_room_under_the_floor() -> None:
    gate = IoGate(floor_bytes=1 << 20)
    first_in, first_out = threading.Event(), threading.Event()
    order: list[str] = []

    def first() -> None:
        with gate.writing(1 << 20):
            first_in.set()
            first_out.wait(LIVE_S)
            order.append("first")

    def second() -> None:
        with gate.writing(1 << 20):
            order.append("second")

    t1 = threading.Thread(target=first)
    t1.start()
    assert first_in.wait(LIVE_S)
    with gate.reading():
        t2 = threading.Thread(target=second)
        t2.start()
        _until(lambda: gate.state().writers_waiting == 1, "the second write waits")
        assert order == []
        first_out.set()          # the write in flight ends: the waiting one moves (the floor)
        t2.join(LIVE_S)
        assert order == ["first", "second"]
        with gate.writing(1 << 20):   # alone in flight beside a read: never waits for the read
            assert gate.state() == (1, 1 << 20, 0)
    t1.join(LIVE_S)
    assert gate.writes_held == 1 and gate.state() == (0, 0, 0)


def test_without_reads_writes_never_wait() -> None:
    gate = IoGate()
    with gate.writing(1), gate.writing(2), gate.writing(3):
        assert gate.state() == (0, 6, 0)
    assert gate.writes_held == 0


def test_a_commit_round_waits_for_the_reads_in_flight_but_not_for_ever() -> None:
    gate = IoGate()
    assert gate.quiet(0.0)                       # no read: at once
    with gate.reading():
        assert not gate.quiet(0.001)             # a read that does not end: the round goes on
        done: list[bool] = []
        t = threading.Thread(target=lambda: done.append(gate.quiet(LIVE_S)))
        t.start()
        _until(lambda: gate.quiet_waits == 2, "the round waits")
    t.join(LIVE_S)
    assert done == [True]


def test_the_committers_flushes_come_after_the_reads_in_flight(tmp_path, monkeypatch) -> None:
    """A round's fdatasync is issued only once the read in flight is over (the read held here
    by the test inside the gate)."""
    gate = IoGate(quiet_wait_s=LIVE_S)
    events: list[str] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (events.append("sync"), real(fd))[1])
    with open_store(tmp_path, io_threads=2, gate=gate, pending_bytes=1 << 30) as s:
        k = key(1)
        with gate.reading():
            assert s.put_many([k], [[data(k, PAGE)]]) == [True]
            s.commit_now()
            _until(lambda: gate.quiet_waits >= 1, "the round waits for the read")
            events.append("read done")
        assert s.flush()
    assert events[:2] == ["read done", "sync"], events


def test_runs_and_large_blocks_are_written_in_pieces(tmp_path, monkeypatch) -> None:
    sizes: list[int] = []
    real = os.pwritev

    def pwritev(fd, iov, off):  # type: ignore[no-untyped-def]
        sizes.append(sum(memoryview(b).nbytes for b in iov))
        return real(fd, iov, off)

    with open_store(tmp_path, io_threads=4) as s:
        ks = [key(i) for i in range(8)]
        src, blocks = _pages(ks)
        big = key(50)
        bigdata = data(big, 5 * PAGE + 100)           # unaligned length: through the bounce
        monkeypatch.setattr(os, "pwritev", pwritev)
        assert s.put_many(ks + [big], blocks + [[bigdata]]) == [True] * 9
        monkeypatch.undo()
        assert s.flush()
        dst, outs = _pages([key(-1)] * 8)
        back = bytearray(len(bigdata))
        assert s.get_many(ks + [big], outs + [[back]]) == [True] * 9
        assert dst[:] == src[:] and bytes(back) == bigdata
    assert sizes and max(sizes) <= slab.WRITE_PIECE_BYTES, sizes
    assert sum(sizes) == 8 * slot_format.slot_bytes_for(PAGE) + slot_format.HEADER_BYTES \
        + slot_format.align_up(len(bigdata))


def test_cut_keeps_order_and_alignment() -> None:
    a, b = mmap.mmap(-1, 3 << 20), mmap.mmap(-1, 4096)
    a[:] = os.urandom(3 << 20)
    iov = [b, a, b, memoryview(a)[:1 << 20]]
    parts = slab.cut(iov, 1 << 20)
    assert [sum(memoryview(x).nbytes for x in p) for p in parts] == [1 << 20] * 4 + [8192]
    flat = b"".join(bytes(x) for p in parts for x in p)
    assert flat == b"".join(bytes(x) for x in iov)
    assert all(slab.aligned(p) for p in parts)
    assert slab.cut([], 1 << 20) == []
