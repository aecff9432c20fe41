"""One process of the multi-process metrics test: a real DiskStore, our metrics in multiprocess
mode.

Usage: python tests/metrics/metrics_worker.py STORE_DIR TAG PUTS MISSES
(PROMETHEUS_MULTIPROC_DIR must be set, as SGLang sets it for its scheduler processes.)
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    store_dir, tag, puts, misses = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), \
        int(sys.argv[4])
    assert os.environ.get("PROMETHEUS_MULTIPROC_DIR"), "run with PROMETHEUS_MULTIPROC_DIR"
    from offload.config import Size, StoreConfig
    from offload.metrics import StoreWatch, tier_metrics
    from offload.store.disk.store import DiskStore

    store = DiskStore(StoreConfig(path=store_dir, capacity=Size(64 << 20), min_free=Size(0),
                                  io_threads=2))
    m = tier_metrics()
    m.set_path("cpu")
    watch = StoreWatch(store, m, interval_s=3600)
    keys = [tag.ljust(16, b"-") + i.to_bytes(16, "big") for i in range(puts + misses)]
    block = os.urandom(8192)
    assert all(store.put_many(keys[:puts], [[block]] * puts))
    got = store.get_many(keys, [[bytearray(8192)] for _ in keys])
    assert sum(got) == puts
    m.load_seconds.labels("cpu").observe(0.003)
    watch.close()        # the last poll: the counters reach the metric files
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
