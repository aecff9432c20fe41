"""What one connection's `Session` and `StagedPath` may use of the agent: one narrow, typed value.

`AgentServer` builds one `AgentContext` and hands it to each connection (the way LMCache hands
each connector one `ConnectorContext`): its store, the acknowledgements table, the access rules
and quotas, the NIXL mover (set once the server started with `--transport ucx`), the limits,
the memory budget, the namespace describer, the announcement feed, the challenge buckets and
the counters. A session
never sees the server itself (no server <-> session <-> staged circle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from offload.agent.access import Access
    from offload.agent.acks import Acks
    from offload.agent.budget import Memory
    from offload.agent.describe import Describer
    from offload.agent.direct import Direct
    from offload.agent.feed import Feeds
    from offload.agent.limits import AgentLimits
    from offload.agent.mover import Mover
    from offload.agent.rate import Challenges
    from offload.store.base import BlockStore


@dataclass(eq=False)
class AgentContext:
    name: str                                       # the agent's NIXL / log name
    store: "BlockStore"
    access: "Access"
    acks: "Acks"
    limits: "AgentLimits"
    memory: "Memory"                                # frames and staging, per key and in all
    describer: "Describer"
    feeds: "Feeds"                                  # the announcement feed (ANNOUNCE / FEED)
    challenges: "Challenges"
    count: Callable[..., None]                      # count(name, n=1)
    warn: Callable[..., None]                       # warn(kind, tenant, msg, *args): the
                                                    # log, rate-limited per kind and host key
    say: Callable[..., None]                        # say(kind, tenant, level, msg, *args):
                                                    # the same, at any level (INFO lines)
    counters: Callable[[], "dict[str, int]"]
    admit: Callable[[str], "str | None"]            # an authenticated host: None, or why not
    release: Callable[["str | None"], None]         # a connection ended
    direct: Callable[[], "Direct | None"]           # the zero-copy moves, if the store allows
    stopping: Callable[[], bool]
    mover: "Mover | None" = None                    # set by `AgentServer.start` (ucx)
