"""KV pages through SGLang's zero-copy interface: `KvPages`, a part of `OffloadStorage`.

- `exists(keys)`: SGLang's `batch_exists`: the leading run of KV pages all of whose objects are
  stored, cut by the worth-it rule (`worth_loading`), noted for the rule's measurements.
- `set_v1(keys, host_indices, prefix_keys)` / `get_v1(keys, host_indices)`: `batch_set_v1` /
  `batch_get_v1`: the KV pool's pages moved by `page_io.move`, recorded (`Recorder`), the
  write-back and load noted for the worth-it rule, a write-back announced as L3 KV events.
- `move(keys, host_indices, write)`: the move alone (the v2 calls' KV entry).

Under DeepSeek-V4's logical anchor there are no KV bytes: `exists` is 0 (SGLang asks v2), a move
is all True (the sidecars decide). Before the attach there is no KV pool: every page is a miss.
Data path: SGLang's calls are guarded by `never_raises` on the face; nothing here catches.
"""

from __future__ import annotations

from typing import Any, Sequence

from offload.hicache import page_io
from offload.hicache.recorder import Recorder
from offload.hicache.state import BackendState
from offload.store.base import leading


class KvPages:
    def __init__(self, st: BackendState, rec: Recorder):
        self.st, self.rec = st, rec

    def hits(self, keys: Sequence[str]) -> int:
        """The leading run of KV pages all of whose objects are stored."""
        kv = self.st.kv
        return leading(page_io.present(self.st.store, kv, keys)) if kv is not None else 0

    def worth_loading(self, hits: int, page_bytes: int = 0) -> int:
        """The leading hits worth loading (the worth-it rule over pages of `page_bytes`, by default
        the KV page's), counted in the metrics."""
        st = self.st
        pages = st.kv.pages if st.kv is not None else None
        if hits == 0 or pages is None:
            return hits
        n = st.worth.pages_to_load(hits, pages.index_step, page_bytes or pages.page_bytes)
        if st.tm is not None:
            st.tm.accepted.inc(n)
            if n < hits:
                st.tm.declined.inc(hits - n)
        return n

    def exists(self, keys: Sequence[str]) -> int:
        st = self.st
        if st.logical_anchor:
            return 0   # no bytes to verify without the pools (SGLang asks v2 for those)
        hits = self.hits(keys)
        n = self.worth_loading(hits)
        pages = st.kv.pages if st.kv is not None else None
        if pages is not None:     # what the rule measures: a miss's prefill, a hit's cost
            st.worth.note_query(keys, hits, n, pages.index_step, pages.page_bytes)
        return n

    def move(self, keys: Sequence[str], host_indices: Any, write: bool) -> list[bool]:
        """Store or load the KV pages at `host_indices` under `keys`, recorded."""
        st = self.st
        if st.logical_anchor:     # zero KV bytes: the v2 pools carry (and decide) every page
            return [True] * len(keys)
        if st.kv is None:         # not attached
            return [False] * len(keys)
        return self.rec.moved(st.kv, write, len(keys),
                              page_io.move(st.store, st.kv, keys, host_indices, write))

    def set_v1(self, keys: Sequence[str], host_indices: Any,
               prefix_keys: Sequence[str] | None) -> list[bool]:
        st = self.st
        ok = self.move(keys, host_indices, write=True)
        if st.logical_anchor:
            return ok
        st.worth.note_stored(keys)
        if st.events is not None and st.is_writer:
            st.events.stored(keys, ok, prefix_keys)
        return ok

    def get_v1(self, keys: Sequence[str], host_indices: Any) -> list[bool]:
        st = self.st
        ok = self.move(keys, host_indices, write=False)
        if st.logical_anchor:
            return ok
        kv_pages = st.kv.pages if st.kv is not None else None
        st.worth.note_loaded(keys, kv_pages.page_bytes if kv_pages is not None else 0)
        return ok
