"""`bench store` times a put until it is durable: the store's `flush()` (the last group commit)
runs inside the timed put, not after the clock stopped."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from offload.bench import store as bench
from offload.store.disk.store import DiskStore

pytestmark = pytest.mark.slow


def test_put_figure_includes_the_flush(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = {"on": False}
    seen: list[tuple[str, bool]] = []

    def timed(fn: Callable[[], object]) -> float:
        clock["on"] = True
        try:
            fn()
        finally:
            clock["on"] = False
        return 1.0

    real_flush = DiskStore.flush

    def flush(self: DiskStore, timeout: float | None = None) -> bool:
        seen.append(("flush", clock["on"]))
        return real_flush(self, timeout)

    monkeypatch.setattr(bench, "timed", timed)
    monkeypatch.setattr(DiskStore, "flush", flush)
    r = bench.bench_size(str(tmp_path), 64 << 10, 512 << 10, 4, 2)
    assert r["blocks"] == 8
    assert seen and seen[0] == ("flush", True)   # the first flush is the put's own, on the clock
