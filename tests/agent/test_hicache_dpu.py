"""SGLang's HiCache backend (`offload.hicache.OffloadStorage`) in dpu mode: its store is an
AgentStore on a real agent process, its host pool registered with NIXL; pages byte-identical."""

from __future__ import annotations

import pytest

from tests.agent.conftest import SECRET, needs_nixl

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
hicache = pytest.importorskip("offload.hicache")
hp = pytest.importorskip("tests.hicache.hicache_pools")


@needs_nixl
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_hicache_backend_pages_through_the_agent(agent_factory, tmp_path, monkeypatch,
                                                 layout: str) -> None:
    """Configured as a user would (transfer.path dpu + agent address); no injection."""
    agent = agent_factory("--memory")
    monkeypatch.setenv("SGLANG_OFFLOAD_SECRET", SECRET.decode())
    host = hp.host_pool(hp.device_pool(False), layout, pages=16)
    sc = hp.storage_config(hp.extra(str(tmp_path / "unused"), transfer={"path": "dpu"},
                                    agent={"address": agent.address, "transport": "ucx",
                                           "timeout_s": 5}), layout=layout)
    backend = hp.make_backend(sc, host)   # the backend registers the host pool with NIXL itself
    store = backend.store
    try:
        P = hp.PAGE
        keys = [f"{i:064x}" for i in range(1, 7)]
        hp.fill(host, 11)
        want = [hp.page_bytes(host, i * P) for i in range(6)]
        assert backend.batch_set_v1(keys, torch.arange(0, 6 * P)) == [True] * 6
        assert backend.batch_exists(keys) == 6
        hp.fill(host, 12)                          # overwrite the pool, then read back elsewhere
        assert backend.batch_get_v1(keys, torch.arange(8 * P, 14 * P)) == [True] * 6
        assert [hp.page_bytes(host, i * P) for i in range(8, 14)] == want
        extra = store.stats().extra
        assert extra["agent_bytes_nixl_in"] > 0 and extra["agent_bytes_nixl_out"] > 0
        assert "agent_bytes_inline_in" not in extra      # the host sent descriptors, not bytes
    finally:
        backend.close()
