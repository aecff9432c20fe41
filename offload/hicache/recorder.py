"""The metrics of the backend's moves: `Recorder`, a part of `OffloadStorage` (`state.py`).

`moved(pool, write, asked, page_io.move(...))` passes a move's flags on and records it when
bytes moved; `record(kind, pool, n, nbytes, seconds, asked)` notes one prefetch or backup call that moved n
pages of `pool` (of `asked`): the read bandwidth the worth-it rule uses, our Prometheus metrics
(load / store latency, pages and bytes per pool, the agent's hits when the backend counts them)
and SGLang's own `StorageMetrics`, which `take()` drains (`get_stats`, when SGLang enabled
storage metrics). Thread safe: SGLang's prefetch and backup threads record at once.
"""

from __future__ import annotations

import threading
from typing import Any

from offload.hicache.page_io import Moved
from offload.hicache.pools import Pool
from offload.hicache.state import BackendState
from offload.metrics import count_agent, counted_by_backend


class Recorder:
    def __init__(self, st: BackendState, sglang_metrics: bool):
        self.st = st
        self.sglang_metrics = sglang_metrics
        self.count_agent = counted_by_backend(st.store)   # the agent client's counters are shared
        self._lock = threading.Lock()
        # Since the last take(): pages and GiB/s of each prefetch / backup call.
        self._pgs: dict[str, list[int]] = {"prefetch": [], "backup": []}
        self._bw: dict[str, list[float]] = {"prefetch": [], "backup": []}

    def moved(self, pool: Pool, write: bool, asked: int, m: Moved) -> list[bool]:
        """`m`'s flags, the move recorded if it moved bytes (of `asked` pages of `pool`)."""
        if m.seconds is not None:
            n = sum(m.ok)
            self.record("backup" if write else "prefetch", pool.name, n, n * pool.page_bytes,
                        m.seconds, asked)
        return m.ok

    def record(self, kind: str, pool: str, n: int, nbytes: int, seconds: float,
               asked: int = 0) -> None:
        """One `kind` ("prefetch" or "backup") call that moved n pages (`nbytes`) of `pool` out
        of `asked`, in `seconds`."""
        st, tm = self.st, self.st.tm
        dt = max(seconds, 1e-9)
        if kind == "prefetch" and n:
            bw = st.worth.observe(nbytes, dt)
            if tm is not None and bw is not None:
                tm.read_bandwidth.set(bw)
        if tm is not None:
            (tm.load_seconds if kind == "prefetch" else
             tm.store_seconds).labels(st.transfer_path).observe(dt)
            kv_pages = st.kv.pages if st.kv is not None else None
            if kind == "prefetch" and pool == "kv" and kv_pages is not None:
                tm.loaded(st.transfer_path, n, dt, kv_pages.index_step, st.worth.prefill_tps)
            direction = "read" if kind == "prefetch" else "write"
            tm.pool_pages.labels(pool, direction).inc(n)
            tm.pool_bytes.labels(pool, direction).inc(nbytes)
            if self.count_agent:
                read = kind == "prefetch"
                count_agent(tm, n if read else 0, max(asked - n, 0) if read else 0,
                            nbytes if read else 0, 0 if read else nbytes)
        if not self.sglang_metrics or n == 0:
            return
        with self._lock:
            self._pgs[kind].append(n)
            self._bw[kind].append(nbytes / dt / (1 << 30))

    def take(self) -> Any:
        """SGLang's `StorageMetrics` since the last call, or None when SGLang did not ask."""
        if not self.sglang_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            pgs, bw = self._pgs, self._bw
            self._pgs = {"prefetch": [], "backup": []}
            self._bw = {"prefetch": [], "backup": []}
        return StorageMetrics(prefetch_pgs=pgs["prefetch"], backup_pgs=pgs["backup"],
                              prefetch_bandwidth=bw["prefetch"], backup_bandwidth=bw["backup"])
