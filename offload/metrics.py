"""Prometheus metrics of the offload tier (`sglang_offload_*`), safe with several processes.

Primitives:
- `TierMetrics`: the metric families, created once per process (`tier_metrics()`), or on a
  private registry (tests, the dashboard check). Every name starts with `sglang_offload_`.
- `StoreWatch(store, metrics, interval_s)`: a daemon thread that reads `store.tier_stats()` every
  `interval_s` and turns the process-local counters of each tier (local NVMe, Redis, agent) into
  Prometheus counter increments and capacity gauges. `poll()` does one round (tests, close).
  A tier's `extra["transfer_failures"]` (a transfer path's failed GPU-side transfers, per kind:
  `offload.transfer.base.FAILURE_KINDS`) becomes `transfer_failures_total{path, kind}`.
  A tier's `extra["process_counters"]`, when present, names the counters that are this process's
  own (none of a shared agent's; its hits and misses through a tiered store).
- `path_of(store)`: the transfer path it stands for (`cpu`, `gds`, `dpu`);
  `counted_by_backend(store)`: whether the backend counts the agent tier's hits itself.
- `serve(cfg, rank)`: our own endpoint on `offload.metrics.port`, for servers that run without
  SGLang's `--enable-metrics`.

How the metrics reach an endpoint: SGLang with `--enable-metrics` sets `PROMETHEUS_MULTIPROC_DIR`
before it starts its scheduler processes, and its HTTP server's `/metrics` reads every process's
files there (`MultiProcessCollector`). The backend runs inside the scheduler processes, and
prometheus_client is imported here only when the first metric is made (after the variable is
set), so our families land in the same directory and appear on SGLang's own `/metrics`. Without
that variable each process has its own registry, served on `port + rank` if a port is set.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from offload.config import MetricsConfig
from offload.store.base import Backlog, BlockStore, HasBacklog, StoreStats, find, never_raises
from offload.transfer.base import FAILURE_KINDS, FAILURES_KEY, TransferPath

log = logging.getLogger(__name__)

PREFIX = "sglang_offload_"
TIERS = ("local", "redis", "agent")
PATHS = ("cpu", "gds", "dpu")
PAGE_BUCKETS = (0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
ENV_DIR = "PROMETHEUS_MULTIPROC_DIR"
# StoreStats counters exported as Prometheus counters: field -> (family attribute, label extra)
_COUNTED = ("hits", "misses", "bytes_read", "bytes_written", "checksum_failures", "evictions",
            "damaged_rows", "index_busy")


def multiprocess_dir() -> str | None:
    """The directory of prometheus_client's multi-process mode, if this process uses it."""
    return os.environ.get(ENV_DIR) or None


class TierMetrics:
    """The metric families. One instance per registry (the default one, or a private one)."""

    def __init__(self, registry: Any = None):
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        reg = REGISTRY if registry is None else registry
        tier = ["tier"]
        self.hits = Counter(PREFIX + "hits", "pages read from a tier (verified)", tier,
                            registry=reg)
        self.misses = Counter(PREFIX + "misses", "pages asked of a tier and not served", tier,
                              registry=reg)
        self.bytes = Counter(PREFIX + "bytes", "bytes moved to (write) or from (read) a tier",
                             ["tier", "direction"], registry=reg)
        self.checksum_failures = Counter(PREFIX + "checksum_failures",
                                         "blocks that failed verification (deleted, a miss)",
                                         tier, registry=reg)
        self.evictions = Counter(PREFIX + "evictions", "blocks evicted to keep the capacity cap",
                                 tier, registry=reg)
        self.damaged_rows = Counter(PREFIX + "damaged_rows",
                                    "index rows that failed the range checks (a miss, dropped)",
                                    tier, registry=reg)
        self.index_busy = Counter(PREFIX + "index_busy",
                                  "data-path index waits past their deadline (a miss or a skip)",
                                  tier, registry=reg)
        self.load_seconds = Histogram(PREFIX + "load_seconds",
                                      "time of one batch load (HiCache prefetch call)", ["path"],
                                      buckets=LATENCY_BUCKETS, registry=reg)
        self.store_seconds = Histogram(PREFIX + "store_seconds",
                                       "time of one batch store (HiCache backup call)", ["path"],
                                       buckets=LATENCY_BUCKETS, registry=reg)
        self.capacity_used = Gauge(PREFIX + "capacity_used_bytes",
                                   "bytes the tier's cap counts as used", tier,
                                   multiprocess_mode="mostrecent", registry=reg)
        self.capacity = Gauge(PREFIX + "capacity_bytes", "capacity cap of the tier", tier,
                              multiprocess_mode="mostrecent", registry=reg)
        self.blocks = Gauge(PREFIX + "blocks", "blocks stored in the tier", tier,
                            multiprocess_mode="mostrecent", registry=reg)
        self.path = Gauge(PREFIX + "path_info", "the transfer path in use (1 = chosen)", ["path"],
                          multiprocess_mode="max", registry=reg)
        self.read_bandwidth = Gauge(PREFIX + "read_bandwidth_bytes_per_second",
                                    "moving average of the tier's measured load bandwidth",
                                    multiprocess_mode="mostrecent", registry=reg)
        self.pool_pages = Counter(PREFIX + "pool_pages",
                                  "pages moved per pool (kv, draft, indexer, mamba, swa, ...)",
                                  ["pool", "direction"], registry=reg)
        self.pool_bytes = Counter(PREFIX + "pool_bytes", "bytes moved per pool",
                                  ["pool", "direction"], registry=reg)
        self.load_page_seconds = Histogram(PREFIX + "load_page_seconds",
                                           "time of one batch load per page it loaded", ["path"],
                                           buckets=PAGE_BUCKETS, registry=reg)
        self.ttft_saved = Counter(PREFIX + "ttft_saved_seconds",
                                  "prefill time the loads saved: tokens loaded / prefill speed "
                                  "- load time (the worth-it rule's estimate)", ["path"],
                                  registry=reg)
        self.write_backlog = Gauge(PREFIX + "write_backlog_pages",
                                   "pages accepted for a tier and not yet written to it", tier,
                                   multiprocess_mode="livesum", registry=reg)
        self.drive_state = Gauge(PREFIX + "drive_state",
                                 "each drive of a store over several (offload.store.paths): 1 for "
                                 "its state (in, full: read not written, out: its blocks are "
                                 "misses), 0 for the others", ["drive", "state"],
                                 multiprocess_mode="mostrecent", registry=reg)
        self.transfer_failures = Counter(PREFIX + "transfer_failures",
                                         "pages a GPU-side transfer failed for, each a miss (a "
                                         "load) or not stored (a store), never loaded",
                                         ["path", "kind"], registry=reg)
        self.declined = Counter(PREFIX + "worth_it_declined_pages",
                                "hit pages not loaded: recomputing them is faster", registry=reg)
        self.accepted = Counter(PREFIX + "worth_it_accepted_pages",
                                "hit pages reported to SGLang for loading", registry=reg)
        for t in TIERS:  # every series exists from the start (rate() needs a first sample)
            for fam in (self.hits, self.misses, self.checksum_failures, self.evictions,
                        self.damaged_rows, self.index_busy):
                fam.labels(t)
            for d in ("read", "write"):
                self.bytes.labels(t, d)
        for p in PATHS:
            self.ttft_saved.labels(p)
        for kind, (p, _) in FAILURE_KINDS.items():
            self.transfer_failures.labels(p, kind)
        self.write_backlog.labels("redis")
        for d in ("read", "write"):
            self.pool_pages.labels("kv", d)
            self.pool_bytes.labels("kv", d)

    def loaded(self, path: str, pages: int, seconds: float, page_tokens: int,
               prefill_tps: float | None) -> None:
        """One batch load of `pages`: the per-page latency, and the prefill time it saved."""
        if pages <= 0:
            return
        self.load_page_seconds.labels(path).observe(seconds / pages)
        if prefill_tps:
            self.ttft_saved.labels(path).inc(max(pages * page_tokens / prefill_tps - seconds, 0.0))

    def set_path(self, chosen: str) -> None:
        for p in PATHS:
            self.path.labels(p).set(1 if p == chosen else 0)


_lock = threading.Lock()
_process_metrics: TierMetrics | None = None


def tier_metrics() -> TierMetrics:
    """This process's metric families (registered once, in the default registry)."""
    global _process_metrics
    with _lock:
        if _process_metrics is None:
            _process_metrics = TierMetrics()
        return _process_metrics


def path_of(store: BlockStore) -> str:
    """The transfer path a store stands for (the `path` label): the `name` (cpu, gds, dpu) of the
    first `TransferPath` on `walk(store)` (the store itself, or a tiered store's local part); a
    bare block store is CPU staging."""
    paths = find(store, TransferPath)
    return paths[0].name if paths and paths[0].name in PATHS else "cpu"


def counted_by_backend(store: BlockStore) -> bool:
    """True when the agent tier's hits and misses must be counted by the backend: the store is
    the agent client itself (the `TransferPath` named `dpu`), whose own counters are agent-wide
    (a tiered store counts them)."""
    return isinstance(store, TransferPath) and store.name == "dpu"


def _tier_stats(store: BlockStore) -> dict[str, StoreStats]:
    return store.tier_stats()


class StoreWatch:
    """Turns a store's cumulative, process-local counters into Prometheus increments.

    The agent's own counters are agent-wide (shared by every host), so for the agent tier only
    the gauges are taken from its stats; its hits and misses come from a `TieredStore`'s
    process-local counters, or, for the agent alone, are counted by the backend (`count_agent`,
    `counted_by_backend`).
    """

    def __init__(self, store: BlockStore, metrics: TierMetrics, interval_s: float = 10.0,
                 stats_of: Callable[[BlockStore], dict[str, StoreStats]] = _tier_stats):
        self.store, self.m, self.interval_s = store, metrics, interval_s
        self._stats_of = stats_of
        self._last: dict[str, dict[str, int]] = {}
        self._stop = threading.Event()
        self._plock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> "StoreWatch":
        self._thread = threading.Thread(target=self._loop, daemon=True, name="offload-metrics")
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    @never_raises("offload metrics: reading the store's tier stats", lambda *_: {}, log)
    def _tiers(self) -> dict[str, StoreStats]:
        return self._stats_of(self.store)

    def poll(self) -> None:
        tiers = self._tiers()
        backlog = self._backlog()
        with self._plock:
            for tier, s in tiers.items():
                self._apply(tier, s)
            for tier, b in backlog.items():
                self.m.write_backlog.labels(tier).set(b.pages)

    @never_raises("offload metrics: reading the write backlog", lambda *_: {}, log)
    def _backlog(self) -> dict[str, Backlog]:
        """Pages the store accepted for a tier and has not written yet, per tier (`HasBacklog`:
        a tiered store's upload queue to the shared tier)."""
        return self.store.backlog() if isinstance(self.store, HasBacklog) else {}

    def _apply(self, tier: str, s: StoreStats) -> None:
        m = self.m
        drives = s.extra.get("drives")
        if isinstance(drives, list):   # a SpreadStore: one state series per drive
            for d in drives:
                for state in ("in", "full", "out"):
                    m.drive_state.labels(str(d["path"]), state).set(int(d["state"] == state))
        m.capacity_used.labels(tier).set(s.bytes_used)
        m.capacity.labels(tier).set(s.capacity)
        m.blocks.labels(tier).set(s.blocks)
        own = s.extra.get("process_counters", _COUNTED)   # agent-wide counters are not ours
        names = [n for n in _COUNTED if n in own]   # type: ignore[operator]
        last = self._last.setdefault(tier, {})
        for name in names:
            now = int(getattr(s, name))
            delta = now - last.get(name, 0)
            if delta < 0:          # the store was reopened: its counters restarted
                delta = now
            last[name] = now
            if delta:
                self._counter(tier, name).inc(delta)
        failures = s.extra.get(FAILURES_KEY)
        if isinstance(failures, dict):   # a transfer path's failed GPU-side transfers
            path = path_of(self.store)
            for kind, n in failures.items():
                delta = int(n) - last.get("failed:" + kind, 0)
                last["failed:" + kind] = int(n)
                if delta > 0:
                    self.m.transfer_failures.labels(path, kind).inc(delta)

    def _counter(self, tier: str, name: str) -> Any:
        m = self.m
        if name == "bytes_read":
            return m.bytes.labels(tier, "read")
        if name == "bytes_written":
            return m.bytes.labels(tier, "write")
        return getattr(m, name).labels(tier)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
        self.poll()


def count_agent(m: TierMetrics, hits: int, misses: int, read: int, written: int) -> None:
    """Hot-path counts for the agent tier (its own counters are agent-wide)."""
    if hits:
        m.hits.labels("agent").inc(hits)
    if misses:
        m.misses.labels("agent").inc(misses)
    if read:
        m.bytes.labels("agent", "read").inc(read)
    if written:
        m.bytes.labels("agent", "write").inc(written)


_served: set[int] = set()


def serve(cfg: MetricsConfig, rank: int = 0, addr: str = "0.0.0.0") -> int | None:
    """Serve metrics on our own port; returns the port, or None if not serving.

    Multi-process mode: every process's files on `cfg.port` (the first process to bind it serves;
    the others find it taken, which is expected). Otherwise: this process's registry on
    `cfg.port + rank`.
    """
    if not cfg.enabled or cfg.port is None:
        return None
    from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

    path = multiprocess_dir()
    port = cfg.port if path else cfg.port + rank
    if port in _served:
        return port
    if path:
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=path)
    else:
        registry = REGISTRY
    try:
        start_http_server(port, addr=addr, registry=registry)
    except OSError as e:
        if path:
            log.debug("offload metrics: port %d taken (another process serves it): %s", port, e)
        else:
            log.warning("offload metrics: cannot serve on port %d: %s", port, e.strerror)
        return None
    _served.add(port)
    log.info("offload metrics on http://%s:%d/metrics (%s)", addr, port,
             "all processes" if path else f"rank {rank}")
    return port


__all__ = ["PREFIX", "TIERS", "TierMetrics", "StoreWatch", "count_agent", "multiprocess_dir",
           "counted_by_backend", "path_of", "serve", "tier_metrics"]
