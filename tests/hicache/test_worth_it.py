"""The worth-it rule: a hit is declined when loading it is slower than recomputing it.

Unit tests of `offload.hicache.worth_it` with a fake clock, and the rule inside the HiCache backend (through
SGLang's factory, real host pools) on a slow tier (declined) and a fast one (accepted).
"""

from __future__ import annotations

import time

import pytest
import torch

from offload.config import WorthItConfig
from offload.hicache import backend as hicache
from offload.hicache.worth_it import Ewma, WorthIt, estimate_prefill_tps, from_config
from offload.store.memory.store import MemoryStore
from tests.hicache import hicache_pools as hp

P = hp.PAGE
KEYS = [f"{i:064x}" for i in range(1, 9)]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_ewma_weights_new_samples():
    e = Ewma(alpha=0.5)
    assert e.value is None
    assert e.observe(100, 1.0) == 100
    assert e.observe(300, 1.0) == 200
    assert e.observe(0, 1.0) == 200            # an empty call changes nothing
    with pytest.raises(ValueError):
        Ewma(alpha=0)


def test_rule_declines_slow_and_accepts_fast():
    clock = Clock()
    # 1000 tokens/s prefill; a page is 16 tokens of 1 KiB each: break-even at 1.024 MB/s
    w = WorthIt(WorthItConfig(), 1000.0, "configured", clock=clock, probe_s=30)
    assert w.pages_to_load(4, 16, 16 << 10) == 4          # nothing measured yet: load, measure
    w.observe(100_000, 1.0)                               # 0.1 MB/s: ten times too slow
    assert w.pages_to_load(4, 16, 16 << 10) == 0
    assert w.declined == 4
    clock.t = 31                                          # long without a sample: probe once
    assert w.pages_to_load(4, 16, 16 << 10) == 4
    assert w.pages_to_load(4, 16, 16 << 10) == 0
    for _ in range(30):                                   # the tier got fast
        w.observe(100_000_000, 1.0)
    assert w.pages_to_load(4, 16, 16 << 10) == 4
    assert w.pages_to_load(0, 16, 16 << 10) == 0


def test_rule_off_or_without_prefill_speed_accepts_everything():
    off = WorthIt(WorthItConfig(enabled=False), 1000.0)
    unknown = WorthIt(WorthItConfig(), None, "model unknown")
    for w in (off, unknown):
        w.observe(1, 1.0)
        assert w.pages_to_load(4, 16, 16 << 10) == 4


def test_prefill_estimate_from_the_plan_module():
    tps, source = estimate_prefill_tps("meta-llama/Llama-3.1-8B-Instruct", "NVIDIA H100 80GB HBM3")
    assert tps is not None and tps > 1000 and "H100" in source and "estimated" in source
    tps2, _ = estimate_prefill_tps("Llama-3.1-8B", "NVIDIA H100 80GB HBM3", tp_size=2)
    assert tps2 == pytest.approx(2 * tps)
    assert estimate_prefill_tps("test/model", "NVIDIA H100 80GB HBM3")[0] is None
    assert estimate_prefill_tps("Llama-3.1-8B", None)[0] is None
    assert estimate_prefill_tps("Llama-3.1-8B", "Tesla T4")[0] is None
    configured = from_config(WorthItConfig(prefill_tokens_per_s=5.0), "x", 1, lambda: None)
    assert configured.enabled and configured.prefill_tps == 5.0
    guessed = from_config(WorthItConfig(), "Llama-3.1-8B", 1, lambda: "NVIDIA H200")
    assert guessed.enabled and guessed.source.startswith("estimated")


class SlowStore(MemoryStore):
    """A tier that reads at well under 1 MB/s (a sleep per batch; only ever slower than that)."""

    def get_many(self, keys, dests):
        time.sleep(0.25)
        return super().get_many(keys, dests)


def _backend(tmp_path, store, **worth_it):
    host = hp.host_pool(hp.device_pool(), "page_first", pages=16)
    sc = hp.storage_config(hp.extra(str(tmp_path / "store"), worth_it=worth_it))
    b = hp.make_backend(sc, host)
    assert isinstance(b.store, type(store))
    return b, host


# 32 KiB pages of 16 tokens (2 KiB/token): at 4000 tokens/s break-even is 8.2 MB/s. The slow
# tier reads 128 KiB per 0.25 s (<= 0.52 MB/s); the in-memory one moves hundreds of MB/s.
TPS = 4000.0


@pytest.mark.parametrize("slow", [True, False], ids=["slow-tier-declined", "fast-tier-accepted"])
def test_backend_declines_a_hit_on_a_slow_tier(tmp_path, monkeypatch, slow):
    from prometheus_client import REGISTRY

    store = SlowStore() if slow else MemoryStore()
    monkeypatch.setattr(hicache, "_open_store", lambda cfg: store)
    b, host = _backend(tmp_path, store, prefill_tokens_per_s=TPS)
    assert b.pages.page_bytes == 32 << 10 and b.pages.page_size == P
    hp.fill(host, 1)
    idx = torch.arange(0, 4 * P)
    assert all(b.batch_set_v1(KEYS[:4], idx))
    assert b.batch_exists(KEYS[:4]) == 4                  # not measured yet
    before = REGISTRY.get_sample_value("sglang_offload_worth_it_declined_pages_total") or 0
    assert all(b.batch_get_v1(KEYS[:4], torch.arange(4 * P, 8 * P)))   # measures the tier
    assert (b.worth.bandwidth.value < 8.2e6) == slow
    assert b.batch_exists(KEYS[:4]) == (0 if slow else 4)
    after = REGISTRY.get_sample_value("sglang_offload_worth_it_declined_pages_total")
    assert after - before == (4 if slow else 0)
    b.close()


def test_backend_rule_can_be_turned_off(tmp_path, monkeypatch):
    store = SlowStore()
    monkeypatch.setattr(hicache, "_open_store", lambda cfg: store)
    b, host = _backend(tmp_path, store, prefill_tokens_per_s=TPS, enabled=False)
    assert all(b.batch_set_v1(KEYS[:2], torch.arange(0, 2 * P)))
    assert all(b.batch_get_v1(KEYS[:2], torch.arange(2 * P, 4 * P)))
    assert b.batch_exists(KEYS[:2]) == 2
    b.close()


def test_prefill_speed_measured_from_a_miss_and_its_write_back():
    clock = Clock()
    w = WorthIt(WorthItConfig(), None, "no GPU visible", clock=clock)
    assert w.prefill_tps is None and w.source.startswith("measured from the first requests")
    w.note_query(KEYS[4:8], 1, 1, 16, 1024)    # a hit, then computed pages: the load is in the
    w.note_query(KEYS[:3], 0, 0, 16, 1024)     # time, no sample; a miss: 3 pages (48 tokens)
    clock.t = 0.5
    w.note_stored(KEYS[5:8])                    # the computed pages after the hit
    assert w.prefill_tps is None
    w.note_stored(KEYS[:3])                     # the miss's write-back: 48 tokens in 0.5 s
    assert w.prefill_tps == pytest.approx(96.0)
    w.note_stored(KEYS[:3])                     # a second write-back of the same pages: no sample
    assert w.measured_tps.samples == 1


def test_a_small_hit_slower_than_recomputing_is_skipped_a_large_one_loaded():
    clock = Clock()
    # 1000 tokens/s, 16-token pages of 1 KiB, a 1 GB/s tier: each page saves ~16 ms, and a hit
    # costs 1 s on the prefetch path beyond its bytes: the break-even is ~1000 tokens
    w = WorthIt(WorthItConfig(), 1000.0, "configured", clock=clock)
    w.observe(1 << 30, 1.0)
    w.note_query(KEYS[:4], 4, 4, 16, 1024)
    clock.t = 1.0
    w.note_loaded(KEYS[:4], 1024)               # the hit's last page loaded 1 s after its query
    assert w.overhead.value == pytest.approx(1.0, abs=1e-3)
    assert w.threshold_tokens() == pytest.approx(1000, rel=0.01)
    assert w.pages_to_load(4, 16, 1024) == 0            # 64 tokens: 64 ms to recompute
    assert w.declined == 4 and w.declined_hits == 1
    assert w.pages_to_load(128, 16, 1024) == 128        # 2048 tokens: 2 s to recompute


def test_a_tier_slower_than_prefill_per_page_is_never_worth_loading():
    w = WorthIt(WorthItConfig(), 1000.0, "configured")
    w.observe(1000, 1.0)                        # 1 KB/s: a 1 KiB page takes ~1 s, recompute 16 ms
    assert w.threshold_tokens(16, 1024) == float("inf")


def test_launch_names_the_source_of_the_prefill_speed():
    from offload.hicache.worth_it import plan_text

    assert "measured from the first requests" in plan_text(WorthItConfig(), "cpu")
    assert "no preset" in plan_text(WorthItConfig(), "cpu")
    assert "2,000 tokens/s (configured)" in plan_text(WorthItConfig(prefill_tokens_per_s=2000.0),
                                                       "cuda")
    assert "off" in plan_text(WorthItConfig(enabled=False), "cpu")


def test_backend_without_a_prefill_speed_measures_it_and_skips_a_slow_small_hit(
        tmp_path, monkeypatch):
    store = MemoryStore()
    monkeypatch.setattr(hicache, "_open_store", lambda cfg: store)
    b, host = _backend(tmp_path, store)          # nothing configured, no GPU: measured
    assert b.worth.prefill_tps is None and b.worth.enabled
    clock = Clock()
    b.worth = WorthIt(WorthItConfig(), None, "test", clock=clock)
    hp.fill(host, 1)
    assert b.batch_exists(KEYS[:4]) == 0         # a miss: SGLang computes the 4 pages
    clock.t = 0.1                                # ... 64 tokens in 0.1 s, then backs them up
    assert all(b.batch_set_v1(KEYS[:4], torch.arange(0, 4 * P)))
    assert b.worth.prefill_tps == pytest.approx(4 * P / 0.1)
    assert b.batch_exists(KEYS[:4]) == 4         # no bandwidth yet: loaded, and measured
    clock.t = 1.1                                # the hit's last page lands 1 s after its query
    assert all(b.batch_get_v1(KEYS[:4], torch.arange(4 * P, 8 * P)))
    assert b.worth.overhead.value == pytest.approx(1.0, abs=0.05)
    assert b.worth.threshold_tokens() > 4 * P
    assert b.batch_exists(KEYS[:4]) == 0         # recomputing (0.1 s) beats loading (1 s)
    assert b.worth.declined == 4
    b.close()


def test_a_slow_first_sample_does_not_stick_and_a_shared_prefix_keeps_its_first_query():
    clock = Clock()
    w = WorthIt(WorthItConfig(), None, clock=clock)
    w.note_query(KEYS[:2], 0, 0, 16, 1024)     # the first request waits 10 s (a JIT build)
    clock.t = 10.0
    w.note_stored(KEYS[:2])
    assert w.prefill_tps == pytest.approx(3.2)
    w.note_query(KEYS[2:4], 0, 0, 16, 1024)    # the next: 32 tokens in 0.1 s
    clock.t = 10.05
    w.note_query(KEYS[2:4], 0, 0, 16, 1024)    # the same prefix asked again before its write-back
    clock.t = 10.1
    w.note_stored(KEYS[2:4])                   # measured from the first query: 320, not 640
    assert w.prefill_tps == pytest.approx(320.0)
