"""The family beyond MHA, end to end — issue 17.

Two families beyond plain MHA, each a demo checkpoint made here (random weights), served on the
CPU by a real SGLang server started through `sglang-offload launch`, HiCache on and the tier as
L3, one start and one restart per family:
- MLA (DeepSeek-V2 architecture, `offload.demo.mla`): SGLang's MLA KV pool and MLA host pool, one
  store block per page holding every layer's latent row (`kv_lora_rank` + RoPE). Needs
  patches/0006.
- hybrid sliding-window attention (Mellum, `offload.demo.swa`): the full and SWA KV pools, the SWA
  host pool stored as the `swa` sidecar for the trailing pages of a prefix. Needs patches/0007
  (without it the restart answers other tokens: the sliding layers read the wrong slots).
A prompt served cold is written back; after a restart the same prompt comes back from L3
(`cached_tokens` = the prompt less its last partial page, all from storage, "HiCache prefetch
success ... loaded=N" in the log) with the same greedy tokens and log-probabilities.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from offload.demo import FAMILIES, DemoSpec
from offload.demo.swa import WINDOW
from offload.launch.server import LaunchedServer, free_port, wait_store
from tests.e2e.conftest import PAGE, assert_agrees, deployment, full_pages, needs_serving, prompt

pytestmark = needs_serving
TOKENS = 1200


# family (written as `demo-model --family` does) -> (a line its pools log at attach, sidecar
# blocks a prompt adds)
SERVED = {
    "mla": (f"{4 * PAGE * (128 + 64) * 2}-byte pages", 0),  # 4 layers x latent
    "swa": ("offload: pool swa (MHATokenToKVPoolHost", WINDOW // PAGE),
}


def _start(tmp: Path, model: Path, store: Path, name: str) -> LaunchedServer:
    port = free_port()
    cfg = deployment(tmp / f"{name}.yaml", model, port, store)
    server = LaunchedServer.start(cfg, tmp / f"{name}.log", f"http://127.0.0.1:{port}",
                                  env={"UCX_MODULES": "^ib"})
    try:
        server.wait_ready()
    except BaseException:
        print(server.tail(80))
        server.stop()
        raise
    return server


@pytest.mark.parametrize("family", sorted(SERVED))
def test_restart_serves_the_repeated_prompt_from_l3(family: str, tmp_path: Path) -> None:
    pools_line, sidecar = SERVED[family]
    model = tmp_path / f"{family}-model"
    FAMILIES[family].write(model, DemoSpec())
    store, text = tmp_path / "store", prompt(TOKENS, 11)
    first = _start(tmp_path, model, store, f"{family}-cold")
    try:
        cold = first.generate(text)
        assert cold.cached_tokens == 0, cold
        blocks = full_pages(cold.prompt_tokens) // PAGE + sidecar    # KV + the window's pages
        assert wait_store(store, blocks) >= blocks, first.tail()
    finally:
        first.stop()
    assert pools_line in first.tail(400)                    # the family's own pools

    second = _start(tmp_path, model, store, f"{family}-restart")
    try:
        hit = second.generate(text)
    finally:
        second.stop()
    assert_agrees(cold, hit, f"{family}: the L3 hit", model)
    assert hit.cached_tokens == full_pages(cold.prompt_tokens), hit
    assert hit.details.get("storage", 0) == hit.cached_tokens, hit.details
    loaded = re.findall(r"HiCache prefetch success .* loaded=(\d+)", second.tail(400))
    assert loaded == [str(hit.cached_tokens)], loaded
