"""The backend's L3 KV events (`offload.events`): built once the key plan is known.

`kv_events_for(st, page_size)`: the `L3Events` tracker of the backend's KV pages (`st`: its
`BackendState`, attached; keyed by
the first object's namespace of the key plan), or None when the store has no tier that tells
(an in-memory store) or when this rank does not write KV pages. Events are an aid to routers: a
ledger that cannot be opened, or a Redis events store that cannot be built (its secret files
are read again by the one loader: one removed or changed since start is refused), is logged and
the backend serves without L3 events.
"""

from __future__ import annotations

import logging
import sqlite3
from typing import TYPE_CHECKING

from offload.errors import ConfigError

if TYPE_CHECKING:
    from offload.events import L3Events
    from offload.hicache.state import BackendState

log = logging.getLogger(__name__)


def kv_events_for(st: "BackendState", page_size: int) -> "L3Events | None":
    if st.kv is None or not st.is_writer:
        return None
    from offload.events import open_events

    plan = st.kv.plan
    try:
        return open_events(st.store, plan.digests[0], page_size, plan.keys, plan.split)
    except (OSError, sqlite3.Error, ConfigError) as e:
        log.warning("offload: no L3 KV events (the events ledger or the Redis events store "
                    "cannot be opened: %s)", e)
        return None
