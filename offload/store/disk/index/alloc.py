"""Where new blocks go: `Alloc`, a part the `Index` holds and delegates to (one connection, one
set of transactions). Slots reserved, made visible, given back, reclaimed.

Two ways to hold slots before a block is visible:
- **Ranges** (the put path, `DiskStore.put_many`): `reserve` hands a process slots of given sizes
  in one unsynced transaction (rows of `reserved`, owned by the process, counted in `used`): what
  its puts need now and, without evicting for them, a range ahead sized by the caller
  (`disk/spare.py`: it grows with what the process writes), which its next puts take with no index
  transaction at all; `unused` slots go back in the same transaction, and the `offer`ed rest of
  the range too when the need would otherwise evict a block. `commit_reserved` (the group committer's synced
  transaction) turns written slots into committed rows, but only slots this process still holds
  (a rebuild or a reclaim may have taken them back: such a block is lost, never made visible);
  a key another process committed meanwhile keeps its row, and this copy's slot is freed.
  `return_reserved` gives slots back (unused ones as they are; written ones punched first).
- **Pending rows** (the slot path of GDS: `allocate` -> `finish` / `release`): a `blocks` row in
  state PENDING per key, owned by the process.
Both are reclaimed from dead processes (`reclaim_dead`: on open, by `cache verify`, and before
evicting under pressure); their slots are punched first, since a dead writer may have written them.
"""

from __future__ import annotations

import sqlite3
import time
from typing import TYPE_CHECKING, Callable, Sequence

from offload.store.disk.index.schema import (
    COMMITTED,
    COUNTED,
    MAX_VARS,
    OP_COMMIT,
    PENDING,
    PUNCH,
    Allocation,
    Freed,
    Location,
    Reserved,
    signed,
)
from offload.store.disk.location import SlotAddr
from offload.store.disk.owner import owner_alive

if TYPE_CHECKING:
    from offload.store.disk.index.db import Index


class Alloc:
    """Where new blocks go: a part of `Index` (which delegates its calls here), working on the
    index's one connection and inside its transactions (`ix.txn`)."""

    def __init__(self, ix: Index) -> None:
        self.ix = ix

    @property
    def db(self) -> sqlite3.Connection:
        return self.ix.db

    # ---- room -----------------------------------------------------------------------------------

    def _make_room(self, need: int, high: float, low: float, free_bytes: Callable[[], int],
                   min_free: int, free_slot: Callable[[Freed], None]
                   ) -> tuple[int, int, int, int, list[Freed]]:
        """Evict (down to the low watermark) if `need` more bytes pass the high one or the file
        system's reserve: (capacity, used, fs free, evicted, freed) after it."""
        cap, used = self.ix.meta("capacity"), self.ix.meta("used")
        fs_free = free_bytes()
        evicted, freed = 0, list[Freed]()
        shortfall = self._shortfall(need, high, lambda: fs_free, min_free)
        if need and shortfall > 0:
            target = max(used + need - int(low * cap), min_free + need - fs_free)
            evicted, freed = self.evict(target, free_slot)
            used = self.ix.meta("used") - self.ix.holding()
            fs_free += sum(f.slot_bytes for f in freed)
        return cap, used, fs_free, evicted, freed

    def _shortfall(self, need: int, high: float, free_bytes: Callable[[], int],
                   min_free: int) -> int:
        """Bytes `need` more would take past the high watermark or the file system's reserve."""
        used = self.ix.meta("used")
        return max(used + need - int(high * self.ix.meta("capacity")),
                   min_free + need - free_bytes(), 0)

    # ---- ranges (the put path) ------------------------------------------------------------------

    def reserve(self, wants: dict[int, tuple[int, int]], owner: str, *, high: float, low: float,
                free_bytes: Callable[[], int], min_free: int, segment_size: int,
                create_segment: Callable[[int, int, int], None],
                free_slot: Callable[[Freed], None], release: Sequence[Location] = (),
                give_back: Sequence[Location] = (), unused: Sequence[SlotAddr] = (),
                offer: Sequence[SlotAddr] = ()) -> Reserved:
        """Per slot size: `need` slots for puts under way (evicting as `allocate` does) and up to
        `extra` more ahead, only from room under the high watermark. One unsynced transaction
        (a reservation lost in a power cut only leaves free slots). `release`: pending rows, and
        `give_back`: written reserved slots, of this process's failed commits (freed first);
        `unused`: reserved slots it gives back unwritten (idle sizes); `offer`: the rest of its
        unwritten range, given back only if the need would otherwise evict a stored block
        (`Reserved.offer_taken`; else the caller keeps it)."""
        with self.ix.txn(durable=False):
            if release:
                self._release(release, free_slot)
            if give_back:
                self._unreserve([(loc.slot_bytes, loc.seg, loc.slot) for loc in give_back], owner,
                                free_slot, punch=True)
            if unused:
                self._unreserve(unused, owner, free_slot, punch=False)
            need = sum(sb * n for sb, (n, _) in wants.items())
            taken_back = bool(offer) and self._shortfall(need, high, free_bytes, min_free) > 0
            if taken_back:   # air before data: this process's range goes before any block
                self._unreserve(offer, owner, free_slot, punch=False)
            cap, used, fs_free, evicted, freed = self._make_room(need, high, low, free_bytes,
                                                                 min_free, free_slot)
            res = Reserved({}, {}, evicted, freed, taken_back)
            taken = 0
            for sb, (n, extra) in sorted(wants.items()):
                k = 0
                while k < n and used + sb <= cap and fs_free - sb >= min_free:
                    k, used, fs_free = k + 1, used + sb, fs_free - sb
                if k < n:
                    res.short[sb] = (f"store full (used {used} + {sb} > capacity {cap})"
                                     if used + sb > cap else
                                     f"file system full ({fs_free} bytes free, keeping "
                                     f"{min_free})")
                else:
                    ahead = max(0, min(extra, (int(high * cap) - used) // sb,
                                       (fs_free - min_free) // sb))
                    k, used, fs_free = k + ahead, used + ahead * sb, fs_free - ahead * sb
                if not k:
                    continue
                slots = self._take_slots(sb, k, segment_size, create_segment)
                self.db.executemany("INSERT INTO reserved VALUES(?,?,?,?)",
                                    ((sb, seg, slot, owner) for seg, slot in slots))
                res.slots[sb] = slots
                taken += k * sb
            self.ix.add_used(taken)
        return res

    def commit_reserved(self, good: Sequence[tuple[Location, int]], failed: Sequence[Location],
                        owner: str, free_slot: Callable[[Freed], None]) -> list[Location]:
        """Make written, synced slots visible (one synced transaction, a few statements per
        batch) and free the slots of failed writes. Returns the blocks not made visible because
        their slot is no longer this process's (a rebuild or a reclaim took it): lost, their slots
        left alone."""
        now = time.time()
        with self.ix.txn():
            held: set[SlotAddr] = set()
            by_size: dict[int, list[tuple[int, int]]] = {}
            for loc, _ in good:
                by_size.setdefault(loc.slot_bytes, []).append((loc.seg, loc.slot))
            for sb, slots in by_size.items():
                held.update((sb, seg, slot) for seg, slot in self.held(owner, sb, slots))
            mine = [(loc, c) for loc, c in good if (loc.slot_bytes, loc.seg, loc.slot) in held]
            lost = [loc for loc, _ in good if (loc.slot_bytes, loc.seg, loc.slot) not in held]
            self.db.executemany("DELETE FROM reserved WHERE slot_bytes=? AND seg=? AND slot=?",
                                ((loc.slot_bytes, loc.seg, loc.slot) for loc, _ in mine))
            before = self.db.total_changes
            self.db.executemany(
                "INSERT OR IGNORE INTO blocks VALUES(?,?,?,?,?,?,1,NULL,?,?)",
                ((loc.key, loc.seg, loc.slot, loc.length, loc.slot_bytes, signed(c), now, now)
                 for loc, c in mine))
            spare: list[SlotAddr] = []
            done = [loc.key for loc, _ in mine]
            if self.db.total_changes - before < len(mine):   # some stored by another process
                where = {k: (seg, slot) for k, seg, slot in self._where(done)}
                done = [loc.key for loc, _ in mine if where.get(loc.key) == (loc.seg, loc.slot)]
                spare = [(loc.slot_bytes, loc.seg, loc.slot) for loc, _ in mine
                         if where.get(loc.key) != (loc.seg, loc.slot)]
            self.db.executemany("INSERT INTO changes(key, op) VALUES(?,?)",
                                ((k, OP_COMMIT) for k in done))
            self._unreserve([(loc.slot_bytes, loc.seg, loc.slot) for loc in failed], owner,
                            free_slot, punch=True)
            self.ix.recycle(spare, free_slot)   # this copy of a block stored elsewhere meanwhile
            self.ix.add_used(-sum(sb for sb, _, _ in spare))
            self.ix.trim_changes()
        return lost

    def _where(self, keys: Sequence[bytes]) -> list[tuple[bytes, int, int]]:
        out: list[tuple[bytes, int, int]] = []
        for i in range(0, len(keys), MAX_VARS):
            chunk = keys[i:i + MAX_VARS]
            out += self.db.execute(f"SELECT key, seg, slot FROM blocks WHERE key IN "
                                   f"({','.join('?' * len(chunk))})", chunk).fetchall()
        return out

    def return_reserved(self, slots: Sequence[SlotAddr], owner: str,
                        free_slot: Callable[[Freed], None], punch: bool) -> int:
        """Give back slots this process holds (`punch`: they may hold written bytes)."""
        with self.ix.txn(durable=False):
            return self._unreserve(slots, owner, free_slot, punch)

    def held(self, owner: str, slot_bytes: int,
             slots: Sequence[tuple[int, int]]) -> set[tuple[int, int]]:
        """Which of these (seg, slot) of one size `owner` still holds (a read)."""
        out: set[tuple[int, int]] = set()
        for seg in sorted({seg for seg, _ in slots}):
            mine = [slot for sg, slot in slots if sg == seg]
            rows = self.db.execute(
                "SELECT slot FROM reserved WHERE slot_bytes=? AND seg=? AND slot BETWEEN ? AND ? "
                "AND owner=?", (slot_bytes, seg, min(mine), max(mine), owner)).fetchall()
            out.update((seg, r[0]) for r in rows)
        return out

    def _unreserve(self, slots: Sequence[SlotAddr], owner: str | None,
                   free_slot: Callable[[Freed], None], punch: bool) -> int:
        """Free reserved slots still held by `owner` (None: whoever holds them)."""
        mine = []
        for sb, seg, slot in slots:
            q = "DELETE FROM reserved WHERE slot_bytes=? AND seg=? AND slot=?"
            args: tuple[object, ...] = (sb, seg, slot)
            if owner is not None:
                q, args = q + " AND owner=?", args + (owner,)
            if self.db.execute(q, args).rowcount == 1:
                mine.append((sb, seg, slot))
        if punch:
            self.ix.recycle(mine, free_slot)
        else:   # never written: free as they are
            self.db.executemany("INSERT OR IGNORE INTO free_slots VALUES(?,?,?)", mine)
        self.ix.add_used(-sum(sb for sb, _, _ in mine))
        return len(mine)

    # ---- pending rows (the slot path) ----------------------------------------------------------

    def allocate(self, items: Sequence[tuple[bytes, int, int, int]], owner: str, *,
                 high: float, low: float, free_bytes: Callable[[], int], min_free: int,
                 segment_size: int, create_segment: Callable[[int, int, int], None],
                 free_slot: Callable[[Freed], None],
                 release: Sequence[Location] = ()) -> Allocation:
        """Reserve slots for (key, length, slot_bytes, csum) items, evicting LRU blocks if needed.

        One transaction, with a handful of statements per batch (not per block), and not synced:
        a reservation lost in a power cut only leaves free slots (its blocks were never
        visible); the `finish` that makes them visible syncs the log, reservation included.
        `release`: this process's pending slots whose commit failed and whose release failed too
        (e.g. disk full): freed first, in the same transaction, so their keys are storable again.
        """
        res = Allocation([], [], {}, [], 0)
        now = time.time()
        with self.ix.txn(durable=False):
            if release:
                self._release(release, free_slot)
            states = self._states([k for k, *_ in items])
            todo = []
            for item in items:
                st = states.get(item[0])
                if st == COMMITTED:
                    res.present.append(item[0])
                elif st == PENDING:
                    res.skipped[item[0]] = "being written by another process"
                else:
                    todo.append(item)
                    states[item[0]] = PENDING
            need = sum(sb for _, _, sb, _ in todo)
            if not todo:
                return res
            cap, used, fs_free, res.evicted, res.freed = self._make_room(
                need, high, low, free_bytes, min_free, free_slot)
            by_size: dict[int, list[tuple[bytes, int, int]]] = {}
            taken = 0
            for key, length, sb, csum in todo:
                if used + sb > cap or fs_free - sb < min_free:
                    res.skipped[key] = (f"store full (used {used} + {sb} > capacity {cap})"
                                        if used + sb > cap else
                                        f"file system full ({fs_free} bytes free, keeping "
                                        f"{min_free})")
                    continue
                by_size.setdefault(sb, []).append((key, length, csum))
                used += sb
                fs_free -= sb
                taken += sb
            rows = []
            for sb, group in by_size.items():
                for (key, length, csum), (seg, slot) in zip(
                        group, self._take_slots(sb, len(group), segment_size, create_segment)):
                    rows.append((key, seg, slot, length, sb, signed(csum), PENDING, owner, now,
                                 now))
                    res.new.append(Location(key, seg, slot, sb, length, csum))
            self.db.executemany("INSERT INTO blocks VALUES(?,?,?,?,?,?,?,?,?,?)", rows)
            self.ix.add_used(taken)
        return res

    def _states(self, keys: Sequence[bytes]) -> dict[bytes, int]:
        out: dict[bytes, int] = {}
        for i in range(0, len(keys), MAX_VARS):
            chunk = keys[i:i + MAX_VARS]
            q = f"SELECT key, state FROM blocks WHERE key IN ({','.join('?' * len(chunk))})"
            out.update(self.db.execute(q, chunk).fetchall())
        return out

    def _take_slots(self, sb: int, n: int, segment_size: int,
                    create_segment: Callable[[int, int, int], None]) -> list[tuple[int, int]]:
        """n slots of `sb` bytes: freed ones first (in slab order), then the unused tails of
        segments (consecutive, so a batch is written with few calls), then new segments."""
        out: list[tuple[int, int]] = self.db.execute(
            "SELECT seg, slot FROM free_slots WHERE slot_bytes=? ORDER BY seg, slot LIMIT ?",
            (sb, n)).fetchall()
        self.db.executemany("DELETE FROM free_slots WHERE slot_bytes=? AND seg=? AND slot=?",
                            ((sb, seg, slot) for seg, slot in out))
        while len(out) < n:
            row = self.db.execute("SELECT seg, next_slot, nslots FROM segments WHERE slot_bytes=? "
                                  "AND next_slot < nslots LIMIT 1", (sb,)).fetchone()
            if row is None:
                nslots = max(1, segment_size // sb)
                seg = self.db.execute("SELECT coalesce(max(seg), 0) + 1 FROM segments").fetchone()[0]
                create_segment(seg, sb, nslots)
                self.db.execute("INSERT INTO segments VALUES(?,?,?,0)", (seg, sb, nslots))
                row = (seg, 0, nslots)
            seg, first, nslots = row
            k = min(n - len(out), nslots - first)
            self.db.execute("UPDATE segments SET next_slot=? WHERE seg=?", (first + k, seg))
            out += [(seg, slot) for slot in range(first, first + k)]
        return out

    def finish(self, committed: Sequence[tuple[bytes, int]], failed: Sequence[Location],
               touched: Sequence[bytes], free_slot: Callable[[Freed], None]) -> None:
        """Make written blocks visible; free the slots of blocks whose write failed."""
        now = time.time()
        with self.ix.txn():
            self.db.executemany("UPDATE blocks SET state=1, owner=NULL, csum=?, atime=? WHERE "
                                "key=? AND state=0", ((signed(c), now, k) for k, c in committed))
            self.db.executemany("INSERT INTO changes(key, op) VALUES(?,?)",
                                ((k, OP_COMMIT) for k, _ in committed))
            self.ix.free_rows(((loc.key, loc.seg, loc.slot, loc.slot_bytes, PENDING)
                             for loc in failed), free_slot)
            self.ix.set_atime(touched, now)
            self.ix.trim_changes()

    def _release(self, locs: Sequence[Location], free_slot: Callable[[Freed], None]) -> int:
        rows = []
        for loc in locs:
            rows += self.db.execute(
                "SELECT key, seg, slot, slot_bytes, state FROM blocks WHERE key=? AND seg=? "
                "AND slot=? AND +state=0", (loc.key, loc.seg, loc.slot)).fetchall()
        return len(self.ix.free_rows(rows, free_slot))

    def release(self, locs: Sequence[Location], free_slot: Callable[[Freed], None]) -> int:
        """Free pending slots (a failed commit): only rows still pending at that exact slot."""
        with self.ix.txn(durable=False):
            return self._release(locs, free_slot)

    # ---- eviction and dead processes ------------------------------------------------------------

    def evict(self, target: int, free_slot: Callable[[Freed], None]) -> tuple[int, list[Freed]]:
        freed: list[Freed] = []
        self._reclaim_dead(free_slot, freed)
        got = sum(f.slot_bytes for f in freed)
        evicted = 0
        while got < target:
            rows = self.db.execute("SELECT key, seg, slot, slot_bytes, state FROM blocks WHERE "
                                   "state=1 ORDER BY atime LIMIT 64").fetchall()
            if not rows:
                break
            chosen = []
            for row in rows:
                if got >= target:
                    break
                chosen.append(row)
                got += row[3]
            freed += self.ix.free_rows(chosen, free_slot)
            evicted += len(chosen)
        return evicted, freed

    def _reclaim_dead(self, free_slot: Callable[[Freed], None], out: list[Freed]) -> None:
        rows = self.db.execute("SELECT key, seg, slot, slot_bytes, state, owner FROM blocks "
                               "WHERE state=0").fetchall()
        alive: dict[str, bool] = {}   # one look at each owner's lease per call

        def live(owner: str) -> bool:   # (a PUNCH holder: the process behind its lease)
            owner = owner.removeprefix(PUNCH)
            if owner not in alive:
                alive[owner] = owner_alive(self.ix.directory, owner)
            return alive[owner]

        out += self.ix.free_rows([r[:5] for r in rows if not live(r[5])], free_slot)
        for (owner,) in self.db.execute("SELECT DISTINCT owner FROM reserved").fetchall():
            if live(owner):
                continue
            slots = self.db.execute("SELECT slot_bytes, seg, slot FROM reserved WHERE owner=?",
                                    (owner,)).fetchall()
            self.db.execute("DELETE FROM reserved WHERE owner=?", (owner,))
            out += self.ix.recycle(slots, free_slot)   # a dead writer may have written them
            if not owner.startswith(PUNCH):         # (slots held to punch are not counted)
                self.ix.add_used(-sum(sb for sb, _, _ in slots))

    def reclaim_dead(self, free_slot: Callable[[Freed], None]) -> int:
        """Free the pending rows and reserved slots of dead processes: how many slots."""
        out: list[Freed] = []
        with self.ix.txn():
            self._reclaim_dead(free_slot, out)
        return len(out)

    def reserved_bytes(self) -> int:
        """Bytes of slots reserved by processes and not yet written (counted in `used`)."""
        return int(self.db.execute(
            f"SELECT coalesce(sum(slot_bytes), 0) FROM reserved WHERE {COUNTED}").fetchone()[0])


__all__ = ["Alloc"]
