"""The control connections of one `AgentStore` (the host side), shared by its calls.

Primitives: `ConnPool(settings, hooks, n)` holds `n` `AgentConn`s (several, so that a prefetch,
a GET, need not wait behind a backup, a PUT); `use(deadline)` lends one to a call: a free one,
else the first one released (waited for until the call's deadline; None if it passed);
`released` is signalled whenever one is given back; `drop_all()` closes every connection (the
next call opens it again: after a new registration, or at close).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

from offload.agent.conn import AgentConn, ConnHooks, ConnSettings


class ConnPool:
    def __init__(self, settings: ConnSettings, hooks: ConnHooks, n: int):
        self.conns = [AgentConn(settings, hooks) for _ in range(max(1, n))]
        self.released = threading.Condition()   # signalled when a connection is released

    @contextmanager
    def use(self, deadline: float) -> Iterator[tuple[AgentConn | None, float]]:
        """A free connection (else the first one released, waited for until `deadline`: None if
        it passed), held for one call, and the call's deadline, which every step of it shares."""
        got: AgentConn | None = None
        with self.released:
            while got is None:
                got = next((c for c in self.conns if c.lock.acquire(blocking=False)), None)
                left = deadline - time.monotonic()
                if got is None and (left <= 0 or not self.released.wait(left)):
                    got = next((c for c in self.conns if c.lock.acquire(blocking=False)), None)
                    break
        if got is None:
            yield None, deadline
            return
        try:
            yield got, deadline
        finally:
            with self.released:
                got.lock.release()
                self.released.notify()

    def drop_all(self, wake: bool = False) -> None:
        """Close every connection (each once its call is done); `wake`: then wake every call
        waiting for one."""
        for c in self.conns:
            with c.lock:
                c.drop()
        if wake:
            with self.released:
                self.released.notify_all()
