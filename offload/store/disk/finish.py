"""A disk store's commits: the index transactions that make written slots visible, and what a
failed one frees.

`Finish(state)`: `commit_reserved` is the group committer's transaction (`commit.py`: one synced
transaction per round for the put slots of the reserved range; a slot no longer this process's, taken
back by a rebuild or a reclaim, is lost and never made visible), `committed` its outcome into the
key set and counters, `commit_written` the slot path's synchronous commit (`slots.py`: slots
another path wrote, e.g. GDS). A failed commit frees its slots at once, or, when the index cannot be
written either, in this process's next index transaction (`_give_up`, through the state's
`orphans` / `written_back`).
"""

from __future__ import annotations

import logging
import sqlite3
from typing import Callable

from offload.store.disk.commit import BUSY as COMMIT_BUSY
from offload.store.disk.index.access import BUSY, IndexReplaced
from offload.store.disk.index.db import Index, Location
from offload.store.disk.state import DiskState

log = logging.getLogger("offload.store.disk.store")


class Finish:
    def __init__(self, state: DiskState):
        self.state = state
        self._not_ours: set[tuple[int, int]] = set()   # (seg, slot) a commit found taken back

    def commit_written(self, good: list[tuple[Location, int]], free: list[Location]) -> str:
        """The slot path's commit (`slots.py`: slots written by another path, e.g. GDS): ''
        done, COMMIT_BUSY, else why it failed (`_give_up`: the pending slots freed)."""
        st = self.state

        def run(index: Index) -> None:
            index.finish([(loc.key, c) for loc, c in good], free, [], st.free_slot)
            st.drop_missing(index)

        try:
            return COMMIT_BUSY if st.ix.write(run) is BUSY else ""
        except IndexReplaced as e:
            return f"not committed: {e}"
        except (sqlite3.Error, OSError) as e:
            mine = [loc for loc, _ in good] + free
            return self._give_up(f"index commit failed: {e}", mine,
                                 lambda index: index.release(mine, st.free_slot),
                                 lambda: st.orphans.extend(mine))

    def commit_reserved(self, good: list[tuple[Location, int]], free: list[Location]) -> str:
        """The committer's transaction for put slots (from the reserved range): '' done,
        COMMIT_BUSY (retried), else why it failed (`_give_up`: the slots given back). A slot no
        longer this process's is lost (see `committed`)."""
        st = self.state

        def run(index: Index) -> list[Location]:   # slots of an earlier failure go back too
            lost = index.commit_reserved(good, free + st.written_back, st.owner,
                                         st.free_slot)
            st.written_back = []
            st.drop_missing(index)
            return lost

        try:
            lost = st.ix.write(run)
        except IndexReplaced as e:   # the slots are not ours in the new index: lost, counted
            return f"not committed: {e}"
        except (sqlite3.Error, OSError) as e:
            mine = [loc for loc, _ in good] + free
            slots = [(loc.slot_bytes, loc.seg, loc.slot) for loc in mine]
            return self._give_up(f"index commit failed: {e}", mine,
                                 lambda index: index.return_reserved(
                                     slots, st.owner, st.free_slot, punch=True),
                                 lambda: st.written_back.extend(mine))
        if lost is BUSY:
            return COMMIT_BUSY
        assert isinstance(lost, list)
        self._not_ours.update((loc.seg, loc.slot) for loc in lost)
        return ""

    def _give_up(self, why: str, mine: list[Location], release: Callable[[Index], object],
                 later: Callable[[], None]) -> str:
        """A failed commit's slots: freed now by `release` (a transaction of their own), else by
        this process's next index transaction (`later`, under the write lock). Returns `why`."""
        st = self.state
        try:
            if st.ix.write(release) is not BUSY:
                return why
        except (sqlite3.Error, OSError) as e:
            log.warning("%d slots of a failed commit not freed yet (%s): the next index "
                        "transaction frees them", len(mine), e)
        with st.ix.wlock:
            later()
        return why

    def committed(self, done: list[Location], lost: list[Location], why: str) -> list[Location]:
        """A round's outcome into the key set and the counters; returns the blocks of `done`
        that were not stored after all (their slot was taken back), for the committer's
        `flush` to say so."""
        st = self.state
        gone: list[Location] = []
        if self._not_ours:   # their slots were taken back (a rebuild, a reclaim): not stored
            gone = [loc for loc in done if (loc.seg, loc.slot) in self._not_ours]
            self._not_ours.difference_update((loc.seg, loc.slot) for loc in gone)
            done = [loc for loc in done if loc not in gone]
            lost = lost + gone
            why = why or "its slot was no longer this process's"
        with st.lock:
            st.keys.update(loc.key for loc in done)
            st.stats.puts += len(done)
            st.stats.bytes_written += sum(loc.length for loc in done)
            st.stats.put_skipped += len(lost)
        if lost:
            log.error("%d blocks written but never made visible (%s): they are not stored",
                      len(lost), why)
        return gone


__all__ = ["Finish"]
