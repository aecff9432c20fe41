"""`RequestError`: an authenticated request the agent cannot serve (bounds, grants, quotas,
an unproven endpoint). The `Session` answers it with an ERROR reply and keeps the connection;
raised by the session and its parts (`offload.agent.endpoint`, `offload.agent.put_get`)."""

from __future__ import annotations


class RequestError(Exception):
    """An authenticated request that cannot be served; answered with ERROR, connection kept."""
