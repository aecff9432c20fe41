"""docs/reference/events.md states the bounds the code has (each number there is a constant here)."""

from __future__ import annotations

from pathlib import Path

from offload.agent import feed
from offload.events import feeds, sources, tracker

DOC = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "events.md").read_text()


def _n(x: float) -> str:
    return f"{int(x):,}"


def test_every_bound_in_the_events_reference_is_the_code_s() -> None:
    t = tracker.L3Events([], 64, lambda keys: [])
    for text in (_n(tracker.SNAPSHOT_SLICE), _n(sources.CHANGES_PER_POLL),
                 _n(feeds.PER_POLL), _n(feeds.STREAM_MAX), _n(feed.PER_TENANT), _n(t.max_queued),
                 _n(sources.DiskSource.__init__.__defaults__[-1]),
                 f"{t.interval_s:g} s", f"every {tracker.snapshot_every():g} s",
                 _n(sources.SweepSource.__init__.__defaults__[-1]), tracker.SNAPSHOT_ENV,
                 f"than {_n(feeds.ENTRY_BYTES)} bytes", f"more than {feeds.ENTRY_FIELDS} fields",
                 f"more than {_n(feeds.STREAM_BYTES)} bytes",
                 f"at most once per {feeds.LOG_EVERY_S:g} s"):
        assert text in " ".join(DOC.split()), text     # wherever the lines break
    from sglang.srt.disaggregation.kv_events import KVEventsConfig

    assert f"`buffer_steps`, default {_n(KVEventsConfig().buffer_steps)} batches" in DOC
