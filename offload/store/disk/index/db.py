"""The disk store's persistent index: SQLite in WAL mode. Bookkeeping only; never touches block bytes.

Why SQLite: it is crash-safe (WAL + synchronous=FULL: a commit survives a crash of the process or
the machine), safe for several processes at once (one writer at a time, readers never blocked),
opens in O(1) and checks itself (`PRAGMA quick_check`). Rows are small (~100 B per block). The
schema and row types are in `disk/index/schema.py`; the `changes` log lets every process keep an
in-memory set of committed keys up to date with one indexed query.

Lifecycle of a block (`disk/index/alloc.py`, the `Alloc` part): its slot is held first — from a range of slots
the process reserved ahead (`reserve`, the put path) or as a PENDING row (`allocate`, the slot
path) — counted against the capacity; the bytes are written and made durable by the caller; then
one synced transaction per group makes it COMMITTED, visible (`commit_reserved` / `finish`), or
its slot is freed. What dead processes held is reclaimed on open and under pressure. Here: reads,
deletes, corrupt-row drops, tombstones, segments, the rebuild's bulk insert and maintenance.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from typing import Callable, Iterable, Sequence

from offload.store.disk import cachedir
from offload.store.disk.index.alloc import Alloc
from offload.store.disk.index.repair import ROW, checked, drop_bad, retry_tombstones
from offload.store.disk.index.schema import (
    CHANGES_KEPT,
    COMMITTED,
    COUNTED,
    MAX_VARS,
    OP_COMMIT,
    OP_DELETE,
    SCHEMA,
    SCHEMA_VERSION,
    SIDE_FILES,
    Allocation,
    Freed,
    Location,
    Reserved,
    Txn,
    signed,
    type_problem,
)
from offload.store.disk.location import SlotAddr

log = logging.getLogger(__name__)


class Index:
    """One SQLite connection; callers serialise access (DiskStore holds a lock). Its part
    `alloc` (`index/alloc.py`) places new blocks; the calls below delegate to it."""

    def __init__(self, path: str):
        """Open (or create, 0600) the index. Raises `cachedir.UnsafeFile` if the index, its -wal
        or its -shm is a symlink or not a regular file of the service user."""
        self.path = path
        self.directory = os.path.dirname(os.path.abspath(path))
        created = cachedir.own_file(path, create=True)
        for suffix in SIDE_FILES:
            cachedir.own_file(path + suffix)
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                                  timeout=30.0)
        try:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute("PRAGMA busy_timeout=30000")
            for suffix in SIDE_FILES:  # SQLite makes them with the index's mode (0600): checked
                cachedir.own_file(path + suffix)
        except BaseException:
            self.db.close()
            raise
        if created:
            cachedir.fsync_dir(os.path.dirname(os.path.abspath(path)))
        self.ino = os.stat(path).st_ino
        self.tombstones_pending = True   # slots whose hole punch failed: retried on the next free
        self._to_punch: list[tuple[Freed, Callable[[Freed], None]]] = []   # freed, not committed
        self._punched: list[SlotAddr] = []   # held, punched: to free next
        self._stuck: list[SlotAddr] = []     # held, punch failed: to tombstone next
        self.owner = ""   # this process's lease token (`recovery`): the holder of freed slots
        self.bad_rows = 0   # rows read back that failed the range checks (each a miss, dropped)
        self.alloc = Alloc(self)

    # ---- open-time checks (called under the directory's open lock) ----------------------------

    def check_and_init(self) -> None:
        """Raises sqlite3.DatabaseError if the file is damaged or of an unknown schema."""
        ok = self.db.execute("PRAGMA quick_check").fetchone()
        if not ok or ok[0] != "ok":
            raise sqlite3.DatabaseError(f"quick_check: {ok[0] if ok else 'no answer'}")
        self.db.executescript(SCHEMA)
        with self.txn():
            row = self.db.execute("SELECT value FROM meta WHERE name='schema'").fetchone()
            if row is None:
                self.db.executemany("INSERT INTO meta VALUES(?,?)", [
                    ("schema", SCHEMA_VERSION), ("used", 0), ("capacity", 0)])
            elif row[0] != SCHEMA_VERSION:
                raise sqlite3.DatabaseError(f"unknown index schema {row[0]!r}")
            why = type_problem(self.db)
            if why:
                raise sqlite3.DatabaseError(why)

    def set_capacity(self, capacity: int) -> None:
        with self.txn():
            self.db.execute("UPDATE meta SET value=? WHERE name='capacity'", (capacity,))

    def set_busy_timeout(self, seconds: float) -> None:
        """How long a statement waits for another connection's lock before `database is locked`
        (the data path: `DATA_LOCK_TIMEOUT_S`, then a miss or a skipped write)."""
        self.db.execute(f"PRAGMA busy_timeout={max(0, int(seconds * 1000))}")

    def close(self) -> None:
        self.db.close()

    # ---- transactions -------------------------------------------------------------------------

    def txn(self, write: bool = True, durable: bool = True) -> "Txn":
        """A transaction; `durable=False` commits without syncing the log (a later durable commit
        of this connection or any other syncs it too). Slots it frees are punched only once it
        has committed (`recycle`)."""
        return _IndexTxn(self, write, durable)

    def meta(self, name: str) -> int:
        return int(self.db.execute("SELECT value FROM meta WHERE name=?", (name,)).fetchone()[0])

    def add_used(self, delta: int) -> None:
        self.db.execute("UPDATE meta SET value=value+? WHERE name='used'", (delta,))

    def holding(self) -> int:
        """Bytes of the slots this transaction freed from committed blocks: still counted in
        `used` (held by this process's lease until punched, after the COMMIT: the one rule every
        version sharing the directory reclaims by), but free for what this transaction places."""
        return sum(f.slot_bytes for f, _ in self._to_punch)

    # ---- where new blocks go: the `alloc` part (its docstrings say what each does) -------------

    def reserve(self, wants: dict[int, tuple[int, int]], owner: str, *, high: float, low: float,
                free_bytes: Callable[[], int], min_free: int, segment_size: int,
                create_segment: Callable[[int, int, int], None],
                free_slot: Callable[[Freed], None], release: Sequence[Location] = (),
                give_back: Sequence[Location] = (), unused: Sequence[SlotAddr] = (),
                offer: Sequence[SlotAddr] = ()) -> Reserved:
        return self.alloc.reserve(
            wants, owner, high=high, low=low, free_bytes=free_bytes, min_free=min_free,
            segment_size=segment_size, create_segment=create_segment, free_slot=free_slot,
            release=release, give_back=give_back, unused=unused, offer=offer)

    def commit_reserved(self, good: Sequence[tuple[Location, int]], failed: Sequence[Location],
                        owner: str, free_slot: Callable[[Freed], None]) -> list[Location]:
        return self.alloc.commit_reserved(good, failed, owner, free_slot)

    def return_reserved(self, slots: Sequence[SlotAddr], owner: str,
                        free_slot: Callable[[Freed], None], punch: bool) -> int:
        return self.alloc.return_reserved(slots, owner, free_slot, punch)

    def held(self, owner: str, slot_bytes: int,
             slots: Sequence[tuple[int, int]]) -> set[tuple[int, int]]:
        return self.alloc.held(owner, slot_bytes, slots)

    def allocate(self, items: Sequence[tuple[bytes, int, int, int]], owner: str, *,
                 high: float, low: float, free_bytes: Callable[[], int], min_free: int,
                 segment_size: int, create_segment: Callable[[int, int, int], None],
                 free_slot: Callable[[Freed], None],
                 release: Sequence[Location] = ()) -> Allocation:
        return self.alloc.allocate(
            items, owner, high=high, low=low, free_bytes=free_bytes, min_free=min_free,
            segment_size=segment_size, create_segment=create_segment, free_slot=free_slot,
            release=release)

    def finish(self, committed: Sequence[tuple[bytes, int]], failed: Sequence[Location],
               touched: Sequence[bytes], free_slot: Callable[[Freed], None]) -> None:
        self.alloc.finish(committed, failed, touched, free_slot)

    def release(self, locs: Sequence[Location], free_slot: Callable[[Freed], None]) -> int:
        return self.alloc.release(locs, free_slot)

    def reclaim_dead(self, free_slot: Callable[[Freed], None]) -> int:
        return self.alloc.reclaim_dead(free_slot)

    def reserved_bytes(self) -> int:
        return self.alloc.reserved_bytes()

    # ---- reads --------------------------------------------------------------------------------

    def locate(self, keys: Sequence[bytes]) -> dict[bytes, Location]:
        """Where the committed blocks among `keys` are. A row that fails the range checks is a
        miss for that block only, and is dropped."""
        out: dict[bytes, Location] = {}
        bad: list[tuple[tuple[object, ...], str]] = []
        for i in range(0, len(keys), MAX_VARS):
            chunk = keys[i:i + MAX_VARS]
            q = (f"SELECT {ROW} FROM blocks WHERE +state=1 AND "
                 f"key IN ({','.join('?' * len(chunk))})")
            for row in self.db.execute(q, chunk):
                loc = checked(row, bad)
                if loc is not None:
                    out[loc.key] = loc
        if bad:
            drop_bad(self.db, bad)
            self.bad_rows += len(bad)
        return out

    def committed_keys(self) -> tuple[int, list[bytes]]:
        """(last change seq, every committed key): one consistent snapshot."""
        with self.txn(write=False):
            seq = self.db.execute("SELECT coalesce(max(seq), 0) FROM changes").fetchone()[0]
            keys = [r[0] for r in self.db.execute("SELECT key FROM blocks WHERE +state=1")]
        return seq, keys

    def changes_since(self, seq: int) -> tuple[int, list[tuple[bytes, int]]] | None:
        """Changes after `seq`, or None if the log no longer reaches back that far."""
        rows = self.db.execute("SELECT seq, key, op FROM changes WHERE seq > ? ORDER BY seq",
                               (seq,)).fetchall()
        if rows and rows[0][0] != seq + 1:
            first = self.db.execute("SELECT min(seq) FROM changes").fetchone()[0]
            if first is None or first > seq + 1:
                return None
        return (rows[-1][0] if rows else seq), [(k, op) for _, k, op in rows]

    def usage(self) -> tuple[int, int, int]:
        """(committed blocks, bytes stored, capacity). Stored: slots of committed blocks and of
        the slot path's pending ones, not the ranges processes hold ahead (`reserved_bytes`;
        those count against the cap, so it holds for all processes together, but are no data)."""
        with self.txn(write=False):
            n = self.db.execute("SELECT count(*) FROM blocks WHERE state=1").fetchone()[0]
            return n, self.meta("used") - self.alloc.reserved_bytes(), self.meta("capacity")

    # ---- writes -------------------------------------------------------------------------------

    def free_rows(self, rows: Iterable[tuple[bytes, int, int, int, int]],
                   free_slot: Callable[[Freed], None]) -> list[Freed]:
        """Delete rows (key, seg, slot, slot_bytes, state): slots freed (`recycle`), used bytes
        returned."""
        rows = list(rows)
        if rows:
            self.db.executemany("DELETE FROM blocks WHERE key=?", ((r[0],) for r in rows))
            self.db.executemany("INSERT INTO changes(key, op) VALUES(?,?)",
                                ((r[0], OP_DELETE) for r in rows if r[4] == COMMITTED))
            self.add_used(-sum(r[3] for r in rows))
        return (self.recycle([(sb, seg, slot) for _, seg, slot, sb, st in rows
                               if st != COMMITTED], free_slot)
                + self.recycle([(sb, seg, slot) for _, seg, slot, sb, st in rows
                                 if st == COMMITTED], free_slot, visible=True))

    def recycle(self, slots: Sequence[SlotAddr],
                 free_slot: Callable[[Freed], None], visible: bool = False) -> list[Freed]:
        """Free (slot_bytes, seg, slot) slots (used bytes: the caller's) and return them.

        `free_slot` punches a slot (its header stops naming the block) or raises OSError: such a
        slot becomes a tombstone, never handed out, retried on a later free and at every open.
        A slot whose block was `visible` (committed) is never punched inside this transaction,
        which may still roll back (a full disk failing its COMMIT, a kill) and bring the block's
        row back over punched bytes: it becomes a slot this process holds (`reserved`, owned by
        its lease token like its ranges and counted in `used` like them -- every version sharing
        the directory judges and reclaims such a row by the same rule, see `holding`: never
        handed out, and punched by whoever reclaims it if this process dies),
        punched once the transaction has committed (`_after_commit`), and handed out again by
        this connection's next write transaction (`_release_punched`). Without an owner (a
        tool's index) it waits as a tombstone instead. Any other slot (a write that failed, a
        reserved or pending slot: a rollback gives it back to its holder, never to a block) is
        punched here, which frees its space before the COMMIT needs some."""
        if self.tombstones_pending:   # earlier punches that failed (their rows are long gone)
            self.tombstones_pending = retry_tombstones(self.db, free_slot)
        freed = [Freed(seg, slot, sb) for sb, seg, slot in slots]
        if not slots:
            return freed
        if visible:
            if self.owner:   # held by this process's own lease, counted in `used` like any slot
                self.db.executemany("INSERT OR REPLACE INTO reserved VALUES(?,?,?,?)",
                                    ((sb, seg, slot, self.owner) for sb, seg, slot in slots))
                self.add_used(sum(sb for sb, _, _ in slots))
            else:
                self.db.executemany("INSERT OR IGNORE INTO tombstones VALUES(?,?,?)", slots)
            self._to_punch += [(f, free_slot) for f in freed]
            return freed
        stuck = []
        for f, row in zip(freed, slots):
            try:
                free_slot(f)
            except OSError as e:
                stuck.append(row)
                if len(stuck) == 1:
                    log.error("could not punch or zero freed slots (%s): kept as tombstones, "
                              "retried later", e)
        gone = set(stuck)
        self.db.executemany("INSERT OR IGNORE INTO free_slots VALUES(?,?,?)",
                            (r for r in slots if r not in gone))
        if stuck:
            self.db.executemany("INSERT OR IGNORE INTO tombstones VALUES(?,?,?)", stuck)
            self.tombstones_pending = True
        return freed

    def _after_commit(self) -> None:
        """Punch the slots this transaction freed (its COMMIT succeeded: their rows are gone)."""
        todo, self._to_punch = self._to_punch, []
        failed = 0
        for f, free_slot in todo:
            try:
                free_slot(f)
            except OSError as e:
                failed += 1
                if failed == 1:
                    log.error("could not punch or zero freed slots (%s): kept as tombstones, "
                              "retried later", e)
                self._stuck.append((f.slot_bytes, f.seg, f.slot))
                continue
            self._punched.append((f.slot_bytes, f.seg, f.slot))

    def _sync_log(self) -> bool:
        """Make an unsynced commit durable (fdatasync of SQLite's log, what `synchronous=FULL`
        does) before the slots it freed are punched: a power cut must not bring a deleted row
        back over a punched slot. False if it could not be synced."""
        try:
            fd = os.open(self.path + "-wal", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            log.warning("index log not synced (%s): freed slots are punched later", e)
            return False
        try:
            os.fdatasync(fd)
            return True
        except OSError as e:
            log.warning("index log not synced (%s): freed slots are punched later", e)
            return False
        finally:
            os.close(fd)

    def _release_punched(self) -> None:
        """At the start of a write transaction: the slots punched after this connection's
        earlier commits become free, those whose punch failed tombstones (both lists are
        forgotten only once this transaction commits). Only a slot still held as it was left:
        one a reclaim or a dropped segment took meanwhile is someone else's now."""
        for row, dest in [(r, "free_slots") for r in self._punched] + \
                         [(r, "tombstones") for r in self._stuck]:
            if self.owner:
                held = self.db.execute("DELETE FROM reserved WHERE slot_bytes=? AND seg=? AND "
                                       "slot=? AND owner=?", (*row, self.owner)).rowcount == 1
                if held:
                    self.add_used(-row[0])
            else:
                held = dest == "free_slots" and self.db.execute(
                    "DELETE FROM tombstones WHERE slot_bytes=? AND seg=? AND slot=?",
                    row).rowcount == 1
            if held:
                self.db.execute(f"INSERT OR IGNORE INTO {dest} VALUES(?,?,?)", row)
        if self._stuck:
            self.tombstones_pending = True

    def tombstoned(self) -> list[SlotAddr]:
        """(slot_bytes, seg, slot) of freed slots whose hole punch has not succeeded yet."""
        return self.db.execute("SELECT slot_bytes, seg, slot FROM tombstones").fetchall()

    def touch(self, keys: Sequence[bytes]) -> None:
        """Record last use times. Not synced: they only order eviction, a crash that loses the
        latest ones costs nothing stored, and a synced commit here would put an fsync of the
        index's log on the read path (the next durable commit syncs them anyway)."""
        with self.txn(durable=False):
            self.set_atime(keys, time.time())

    def set_atime(self, keys: Sequence[bytes], now: float) -> None:
        if keys:
            self.db.executemany("UPDATE blocks SET atime=? WHERE key=?", ((now, k) for k in keys))

    def delete(self, keys: Sequence[bytes], free_slot: Callable[[Freed], None]) -> int:
        with self.txn():
            rows = []
            for i in range(0, len(keys), MAX_VARS):
                chunk = keys[i:i + MAX_VARS]
                rows += self.db.execute(
                    "SELECT key, seg, slot, slot_bytes, state FROM blocks WHERE +state=1 AND "
                    f"key IN ({','.join('?' * len(chunk))})", chunk).fetchall()
            return len(self.free_rows(rows, free_slot))

    def drop_corrupt(self, locs: Sequence[Location], free_slot: Callable[[Freed], None],
                     still_bad: Callable[[Location], bool]) -> list[bytes]:
        """Delete blocks a read found bad, only if, inside this write transaction (no process can
        free, reuse or commit a slot meanwhile), the index still holds the very row that was read
        -- the same slot, checksum and generation (`created`) -- and `still_bad(location)`, a
        re-read of the slot now, still finds it bad. A block deleted and put again into the same
        slot meanwhile is another row, and stays; so does one whose re-read is good (the first
        read raced with something) or fails with an I/O error. Returns the keys whose row went.
        Called only through `DiskState.drop_bad`, the one place a block is called bad."""
        with self.txn():
            rows = []
            for loc in locs:
                held = self.db.execute(
                    "SELECT key, seg, slot, slot_bytes, state FROM blocks WHERE key=? AND seg=? "
                    "AND slot=? AND csum=? AND created=? AND +state=1",
                    (loc.key, loc.seg, loc.slot, signed(loc.csum), loc.created)).fetchall()
                if held and still_bad(loc):
                    rows += held
            self.free_rows(rows, free_slot)
            return [r[0] for r in rows]

    def segment_names(self) -> set[tuple[int, int]]:
        """(seg, slot_bytes) of every segment the index names, dropped ones included."""
        return set(self.db.execute("SELECT seg, slot_bytes FROM segments").fetchall())

    def live_segments(self) -> list[tuple[int, int]]:
        """(seg, slot_bytes) of every segment not dropped."""
        return self.db.execute("SELECT seg, slot_bytes FROM segments WHERE nslots > 0").fetchall()

    def drop_segment(self, seg: int) -> list[bytes]:
        """Forget a segment whose slab file is lost: its blocks (pending or committed) and free
        slots go; its row stays as a tombstone (nslots 0) so its id is never given out again.
        Returns the committed keys dropped."""
        with self.txn():
            rows = self.db.execute("SELECT key, slot_bytes, state FROM blocks WHERE seg=?",
                                   (seg,)).fetchall()
            self.db.execute("DELETE FROM blocks WHERE seg=?", (seg,))
            self.db.execute("DELETE FROM free_slots WHERE seg=?", (seg,))
            self.db.execute("DELETE FROM tombstones WHERE seg=?", (seg,))
            held = self.db.execute("SELECT coalesce(sum(slot_bytes), 0) FROM reserved WHERE seg=? "
                                   f"AND {COUNTED}",
                                   (seg,)).fetchone()[0]
            self.db.execute("DELETE FROM reserved WHERE seg=?", (seg,))
            self.db.execute("UPDATE segments SET nslots=0, next_slot=0 WHERE seg=?", (seg,))
            gone = [k for k, _, state in rows if state == COMMITTED]
            self.db.executemany("INSERT INTO changes(key, op) VALUES(?,?)",
                                ((k, OP_DELETE) for k in gone))
            self.add_used(-sum(sb for _, sb, _ in rows) - held)
        return gone

    def evict_to(self, target_used: int, free_slot: Callable[[Freed], None]) -> int:
        with self.txn():
            over = self.meta("used") - self.alloc.reserved_bytes() - target_used   # of what is stored
            return self.alloc.evict(over, free_slot)[0] if over > 0 else 0

    def trim_changes(self) -> None:
        last = self.db.execute("SELECT max(seq) FROM changes").fetchone()[0] or 0
        if last % 1000 == 0 or last > 2 * CHANGES_KEPT:
            self.db.execute("DELETE FROM changes WHERE seq <= ?", (last - CHANGES_KEPT,))

    def record_namespace(self, digest: bytes, description: dict[str, object]) -> None:
        with self.txn():
            self.db.execute("INSERT OR IGNORE INTO namespaces VALUES(?,?)",
                            (digest, json.dumps(description, sort_keys=True)))

    def insert_recovered(self, rows: Sequence[tuple[bytes, int, int, int, int, int, float]],
                         segments: Sequence[tuple[int, int, int, int]],
                         free: Sequence[SlotAddr],
                         tombstones: Sequence[SlotAddr] = ()) -> None:
        """Rebuild: (key, seg, slot, slot_bytes, length, csum, created) rows found in the slabs;
        (slot_bytes, seg, slot) of free slots and of tombstones (freed, not punched yet)."""
        with self.txn():
            self.db.executemany("INSERT OR REPLACE INTO segments VALUES(?,?,?,?)", segments)
            self.db.executemany("INSERT OR IGNORE INTO free_slots VALUES(?,?,?)", free)
            self.db.executemany("INSERT OR IGNORE INTO tombstones VALUES(?,?,?)", tombstones)
            self.db.executemany(
                "INSERT OR IGNORE INTO blocks VALUES(?,?,?,?,?,?,1,NULL,?,?)",
                ((k, seg, slot, length, sb, signed(csum), created, created)
                 for k, seg, slot, sb, length, csum, created in rows))
            used = self.db.execute("SELECT coalesce(sum(slot_bytes), 0) FROM blocks").fetchone()[0]
            self.db.execute("UPDATE meta SET value=? WHERE name='used'", (used,))
            self.db.executemany("INSERT INTO changes(key, op) VALUES(?,?)",
                                ((r[0], OP_COMMIT) for r in rows))

    # ---- maintenance (`sglang-offload cache`) --------------------------------------------------

    def committed_after(self, key: bytes, limit: int) -> list[Location]:
        """Up to `limit` committed blocks with keys after `key`, in key order (a paged scan);
        rows failing the range checks are dropped (counted in `bad_rows`), never returned."""
        while True:
            rows = self.db.execute(f"SELECT {ROW} FROM blocks WHERE key > ? AND +state=1 "
                                   "ORDER BY key LIMIT ?", (key, limit)).fetchall()
            bad: list[tuple[tuple[object, ...], str]] = []
            out = [loc for loc in (checked(r, bad) for r in rows) if loc is not None]
            if bad:
                drop_bad(self.db, bad)
                self.bad_rows += len(bad)
            if out or len(rows) < limit:
                return out
            key = rows[-1][0]   # a whole page of damaged rows: go on after it

    def summary(self) -> dict[str, object]:
        """Blocks, bytes and age per namespace digest (with its description), in one snapshot."""
        with self.txn(write=False):
            per_ns = self.db.execute(
                "SELECT substr(key, 1, 16), count(*), sum(length), sum(slot_bytes), min(created), "
                "max(created), max(atime) FROM blocks WHERE state=1 GROUP BY 1").fetchall()
            described = dict(self.db.execute("SELECT digest, description FROM namespaces"))
            pending = self.db.execute("SELECT count(*) FROM blocks WHERE state=0").fetchone()[0]
            reserved = self.alloc.reserved_bytes()
            used, cap = self.meta("used") - reserved, self.meta("capacity")
        namespaces = []
        for digest in sorted(set(described) | {r[0] for r in per_ns}):
            row = next((r for r in per_ns if r[0] == digest), (digest, 0, 0, 0, None, None, None))
            desc = described.get(digest)
            namespaces.append({
                "digest": bytes(digest).hex(), "blocks": row[1], "data_bytes": row[2] or 0,
                "slot_bytes": row[3] or 0, "oldest": row[4], "newest": row[5],
                "last_use": row[6], "description": json.loads(desc) if desc else None})
        return {"used_bytes": used, "reserved_bytes": reserved, "capacity": cap,
                "pending": pending, "namespaces": namespaces}


class _IndexTxn(Txn):
    """`Index.txn`: a write transaction first frees the slots punched after this connection's
    earlier commits; after its own COMMIT it punches what it freed (a rollback punches nothing)."""

    def __init__(self, index: Index, write: bool, durable: bool):
        super().__init__(index.db, write, durable)
        self.index = index
        self._released: list[SlotAddr] = []

    def __enter__(self) -> "Txn":
        super().__enter__()
        ix = self.index
        ix._to_punch = []
        if self.write and (ix._punched or ix._stuck):
            self._released = ix._punched + ix._stuck
            try:
                ix._release_punched()
            except BaseException:
                self.db.execute("ROLLBACK")
                self._restore()
                raise
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        ix = self.index
        try:
            super().__exit__(exc_type, *rest)
        except BaseException:
            ix._to_punch = []   # rolled back (SQLite undoes a COMMIT it could not finish)
            raise
        if exc_type is not None:
            ix._to_punch = []
            return
        done = set(self._released)
        ix._punched = [s for s in ix._punched if s not in done]
        ix._stuck = [s for s in ix._stuck if s not in done]
        if ix._to_punch and not self.durable and not ix._sync_log():
            ix._stuck += [(f.slot_bytes, f.seg, f.slot) for f, _ in ix._to_punch]
            ix._to_punch = []   # a power cut could still undo the deletion: punched later
        ix._after_commit()


__all__ = ["Allocation", "Freed", "Index", "Location", "SIDE_FILES"]
