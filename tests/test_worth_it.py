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
from offload.store.memory import MemoryStore
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
