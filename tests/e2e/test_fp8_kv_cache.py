"""An FP8 KV cache with the tier, served through `sglang-offload launch` on the CPU (patch 0017).

`kv-cache-dtype: fp8_e4m3` under `sglang:` on the real model: SGLang's pool holds float8 K/V,
torch_native computes in bfloat16, and HiCache writes the fp8 pages to the L3. One cache directory
and one real redis-server are shared, in turn, by an fp8 server, a bf16 server and the fp8 server
again (three start-ups, small prompts: the CI budget):

1. fp8 serves prompt A cold, then again from L1 (the reference: a cold prefill attends over K/V
   not yet quantized, a hit over the fp8 pages); its pages reach the L3;
2. bf16 on the same directory and Redis: A is a miss (fp8 pages are never loaded by a bf16
   server), and it serves B cold: B's pages are bf16 only;
3. fp8 restarted: A comes back from the L3 (storage tokens, the L1 hit's answer at the logprob)
   and B is a miss (bf16 pages are never loaded by an fp8 server);
4. `cache stats --json`: each dtype's namespace holds A's and B's pages, the fp8 one in half the
   bytes of the bf16 one.

The blocks are kept apart by the namespace, which names the host pool's dtype
(`offload.hicache.keying.namespace_for`): the fault of sglang #38362, where Mooncake's keys
ignored --kv-cache-dtype and the two servers read each other's bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from offload import cli
from offload.launch.server import LaunchedServer, Reply, wait_store
from tests.e2e.conftest import PAGE, assert_agrees, full_pages, needs_serving, prompt

pytestmark = needs_serving
TOKENS = 700                        # ~11 pages each
FP8 = {"kv-cache-dtype": "fp8_e4m3"}


def _stored(r: Reply) -> int:
    """Pages a finished request leaves in the L3: SGLang caches its prompt and output less the
    last token (more than a later hit can use: `full_pages`)."""
    return (r.prompt_tokens + len(r.output_ids) - 1) // PAGE


def _miss(r: Reply) -> None:
    assert r.cached_tokens == 0 and not r.details.get("storage"), (r.cached_tokens, r.details)


def _stats(store: Path) -> dict[str, dict]:
    """`cache stats --json` of the directory, its namespaces by dtype."""
    out = subprocess.run([sys.executable, "-m", "offload.cli", "cache", "stats", "--json",
                          str(store)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    by_dtype: dict[str, dict] = {}
    for ns in json.loads(out.stdout)["namespaces"]:
        assert ns["description"]["dtype"] not in by_dtype, ns
        by_dtype[ns["description"]["dtype"]] = ns
    return by_dtype


@pytest.mark.parametrize("argv,expected", [
    (["--url", "http://127.0.0.1:1", "--kv-cache-dtype", "fp8_e4m3"],
     "error: --kv-cache-dtype starts the servers with that dtype: use it with --config"),
    (["--config", "x.yaml", "--kv-cache-dtype", "fp9"], "invalid choice: 'fp9'"),
])
def test_bench_serve_kv_cache_dtype_is_checked_before_any_work(
        argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "serve", *argv]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_bench_serve_sets_the_dtype_over_the_deployment_file(tmp_path: Path) -> None:
    """What `bench serve --kv-cache-dtype` starts its servers from: the file's sglang: keys with
    the dtype set over them."""
    import yaml

    from offload.bench.serve import deployment

    src = tmp_path / "in.yaml"
    src.write_text(yaml.safe_dump({"sglang": {"model-path": "m", "kv-cache-dtype": "auto"},
                                   "offload": {"store": {"path": "/elsewhere"}}}))
    out = yaml.safe_load(deployment(str(src), tmp_path / "store", 1234, FP8).read_text())
    assert out["sglang"]["kv-cache-dtype"] == "fp8_e4m3" and out["sglang"]["model-path"] == "m"
    assert out["offload"]["store"]["path"] == str(tmp_path / "store")


def test_fp8_restarts_from_l3_in_half_the_bytes_and_never_meets_bf16_pages(
        servers: Callable[..., LaunchedServer], tmp_path: Path, real_model: Path) -> None:
    from tests.store.redis_fixtures import RedisProc

    redis = RedisProc(tmp_path / "redis", []).start()
    try:
        shared = {"redis": {"url": redis.url}}
        store = tmp_path / "cache"
        a, b = prompt(TOKENS, 81), prompt(TOKENS, 82)

        fp8 = servers(store, name="fp8", sglang=FP8, model=real_model, **shared)
        cold_a = fp8.generate(a)
        _miss(cold_a)
        # with fp8 KV a cold prefill attends over the prompt's K/V before they are quantized, a
        # hit over the fp8 pages (0.67 nats apart on the real model): the reference of an fp8
        # hit is the same prompt served from L1, whose pages are the ones the L3 holds
        l1_a = fp8.generate(a)
        assert l1_a.cached_tokens == full_pages(cold_a.prompt_tokens), l1_a
        blocks = _stored(cold_a)
        assert wait_store(store, blocks) >= blocks, fp8.tail()
        fp8.stop()

        bf16 = servers(store, name="bf16", model=real_model, **shared)
        replies = [bf16.generate(a), bf16.generate(b)]
        for r in replies:                                # A: fp8 -> bf16, not loaded
            _miss(r)
        blocks += sum(_stored(r) for r in replies)
        assert wait_store(store, blocks) >= blocks, bf16.tail()
        bf16.stop()

        again = servers(store, name="fp8-restart", sglang=FP8, model=real_model, **shared)
        hit = again.generate(a)                          # a restart: L1 and L2 are empty
        assert_agrees(l1_a, hit, "fp8 from L3 against fp8 from L1", real_model)
        assert hit.cached_tokens == full_pages(cold_a.prompt_tokens), hit
        assert hit.details.get("storage", 0) > 0, hit.details
        r = again.generate(b)
        _miss(r)                                         # bf16 -> fp8: not loaded
        blocks += _stored(r)
        assert wait_store(store, blocks) >= blocks, again.tail()
        again.stop()
    finally:
        redis.kill()

    stats = _stats(store)
    assert sorted(stats) == ["bfloat16", "float8_e4m3fn"], sorted(stats)
    f8, b16 = stats["float8_e4m3fn"], stats["bfloat16"]
    assert f8["blocks"] == b16["blocks"] == blocks // 2, (f8["blocks"], b16["blocks"], blocks)
    assert 2 * f8["data_bytes"] == b16["data_bytes"], (f8["data_bytes"], b16["data_bytes"])
