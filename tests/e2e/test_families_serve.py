"""The family beyond MHA, end to end — issue 17.

An MLA model (DeepSeek-V2 architecture, `offload.demo.mla`: random weights, made here) served on
the CPU by a real SGLang server started through `sglang-offload launch`, HiCache on and the tier
as L3: SGLang's MLA KV pool and MLA host pool, one store block per page holding every layer's
latent row (`kv_lora_rank` + RoPE) of the page's 64 tokens. A prompt served cold is written back;
after a restart the same prompt comes back from L3 (`cached_tokens` = the prompt less its last
partial page, SGLang's breakdown naming the storage tier, "HiCache prefetch success ... loaded=N"
in the log) with the same greedy tokens and log-probabilities. Needs patches/0006.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from offload.launch.server import LaunchedServer, free_port, wait_store
from tests.e2e.conftest import PAGE, deployment, full_pages, needs_serving, prompt

pytestmark = needs_serving
TOKENS = 1200


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from offload.demo import DemoSpec
    from offload.demo.mla import write_mla_demo

    out = tmp_path_factory.mktemp("mla-model")
    write_mla_demo(out, DemoSpec())
    return out


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


def _ask(server: LaunchedServer, text: str) -> dict[str, Any]:
    """One greedy request: its text, token ids and their log-probabilities, and cache report."""
    body = json.dumps({"text": text, "return_logprob": True,
                       "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}).encode()
    req = urllib.request.Request(server.url + "/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.load(r)
    meta = out["meta_info"]
    return {"text": out["text"], "ids": [int(t) for _lp, t, _x in meta["output_token_logprobs"]],
            "logprobs": [float(lp) for lp, _t, _x in meta["output_token_logprobs"]],
            "prompt_tokens": int(meta["prompt_tokens"]), "cached": int(meta["cached_tokens"]),
            "details": dict(meta.get("cached_tokens_details") or {})}


def test_mla_restart_serves_the_repeated_prompt_from_l3(mla_model: Path, tmp_path: Path) -> None:
    from offload.demo.mla import KV_LORA_RANK, ROPE_DIM

    store, text = tmp_path / "store", prompt(TOKENS, 11)
    first = _start(tmp_path, mla_model, store, "mla-cold")
    try:
        cold = _ask(first, text)
        assert cold["cached"] == 0, cold
        pages = full_pages(cold["prompt_tokens"]) // PAGE
        assert wait_store(store, pages) >= pages, first.tail()
    finally:
        first.stop()
    page_bytes = 4 * PAGE * (KV_LORA_RANK + ROPE_DIM) * 2       # DemoSpec: 4 layers, bf16
    assert f"{page_bytes}-byte pages" in first.tail(400)        # the MLA host pool's page

    second = _start(tmp_path, mla_model, store, "mla-restart")
    try:
        hit = _ask(second, text)
    finally:
        second.stop()
    assert hit["ids"] == cold["ids"] and hit["text"] == cold["text"]
    assert hit["logprobs"] == pytest.approx(cold["logprobs"], abs=1e-2)
    assert hit["cached"] == full_pages(cold["prompt_tokens"]), hit
    assert hit["details"].get("storage", 0) == hit["cached"], hit["details"]
    loaded = re.findall(r"HiCache prefetch success .* loaded=(\d+)", second.tail(400))
    assert loaded == [str(hit["cached"])], loaded
