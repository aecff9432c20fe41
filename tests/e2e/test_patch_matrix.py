"""The patched SGLang behaves like upstream wherever our tier is not in play (issue 30).

Real `python -m sglang.launch_server` servers on the CPU engine, on the demo model, as a user of
the distribution's SGLang who does not use our tier starts them. Each configuration serves a short
prompt and then the same prompt again (an L1 hit), greedy:
  (a) HiCache (L1 + L2), no storage backend;
  (b) HiCache with SGLang's stock `file` L3, across a restart (the first request after it is served
      from the file store);
  (c) the plain radix cache, no HiCache;
  (d) ours: `sglang-offload launch` (HiCache with the offload tier).

The reference is SGLang 0.5.23 with only the CPU-serving patches a Llama-family CPU server needs to
start (0002-0005; the stock wheel cannot serve on a CPU without them, see docs/distro.md): the
pinned wheel unpacked and patched in a temporary directory, shadowing the installed SGLang through
PYTHONPATH. For (a)-(c) the patched wheel (the installed one: the whole series) must start, return
the reference's tokens, text, cached tokens and their device/host/storage breakdown, and the same
L3 layout answer (/get_hicache_l3_cache_layout); every configuration returns the same tokens. A
patch that changes behaviour for (a)-(c) fails here. Nine server start-ups in all, one at a time
(the reference's first one also byte-compiles its tree).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

from offload.errors import RunError
from offload.launch.server import LaunchedServer, Reply, free_port
from tests.e2e.conftest import PAGE, deployment, full_pages, needs_serving, prompt

# a configuration starts up to four servers inside its first test (module fixture)
pytestmark = [needs_serving, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
CPU_SERVING = ("0002", "0003", "0004", "0005")   # the reference: what a CPU server needs to serve
TOKENS = 330   # five full 64-token pages and a partial one: above SGLang's prefetch threshold (256)
START_TIMEOUT_S = float(os.environ.get("E2E_START_TIMEOUT", "400"))
ENV = {"SGLANG_USE_CPU_ENGINE": "1", "UCX_MODULES": "^ib"}


@dataclass
class Run:
    """What one server (or a server and its restart) answered."""

    replies: list[Reply] = field(default_factory=list)
    layouts: list[Any] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def answers(self) -> list[tuple[Any, ...]]:
        return [(r.output_ids, r.text, r.prompt_tokens, r.cached_tokens,
                 {k: v for k, v in sorted(r.details.items())}) for r in self.replies]


@pytest.fixture(scope="module")
def reference_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pinned wheel unpacked with only the CPU-serving patches applied (a PYTHONPATH root)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_wheel", REPO / "distro" / "build_wheel.py")
    build = sys.modules.setdefault("build_wheel", importlib.util.module_from_spec(spec))
    if not hasattr(build, "patch_tree"):  # distro/ is deliberately not a package
        spec.loader.exec_module(build)
    pin = build.load_pin()
    wheel = build.fetch_wheel(pin, build.pick_wheel(pin))
    patches = [p for p in build.read_series() if p.name[:4] in CPU_SERVING]
    assert [p.name[:4] for p in patches] == list(CPU_SERVING), patches
    tree = tmp_path_factory.mktemp("reference-sglang")
    build.patch_tree(wheel, tree, patches)
    return tree


def _flags(model: Path, port: int) -> list[str]:
    return ["--model-path", str(model), "--device", "cpu", "--attention-backend", "torch_native",
            "--disable-cuda-graph", "--host", "127.0.0.1", "--port", str(port),
            "--page-size", str(PAGE), "--max-total-tokens", "8192", "--enable-cache-report"]


HICACHE = ["--enable-hierarchical-cache", "--hicache-ratio", "2"]


def _file_l3(directory: Path) -> list[str]:
    return [*HICACHE, "--hicache-storage-backend", "file",
            "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config",
            json.dumps({"file_storage_path": str(directory)})]


def _plain_server(model: Path, extra: list[str], log: Path, pythonpath: Path | None
                  ) -> LaunchedServer:
    port = free_port()
    env = {**os.environ, **ENV}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath),
                                                          env.get("PYTHONPATH", "")]))
    argv = [sys.executable, "-m", "sglang.launch_server", *_flags(model, port), *extra]
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, cwd=log.parent,
                                start_new_session=True)
    return LaunchedServer(f"http://127.0.0.1:{port}", proc, log)


HOST_MEMORY = "Not enough host memory available"   # SGLang's own check at start (a busy box)


def _start(model: Path, extra: list[str], log: Path, pythonpath: Path | None,
           tries: int = 4) -> LaunchedServer:
    return _ready(lambda: _plain_server(model, extra, log, pythonpath), log, tries)


def _ready(make: Callable[[], LaunchedServer], log: Path, tries: int = 4) -> LaunchedServer:
    """A ready server; a start refused only for SGLang's host-memory reserve (10 GiB free beyond
    the pool, pool_host/base.py: other jobs on the machine) is retried, nothing else is."""
    import time

    for attempt in range(tries):
        offset = log.stat().st_size if log.exists() else 0
        server = make()
        try:
            server.wait_ready(START_TIMEOUT_S)
            return server
        except RunError:
            server.stop(grace=10)
            with log.open("rb") as f:
                f.seek(offset)
                this_try = f.read().decode(errors="replace")
            if attempt == tries - 1 or HOST_MEMORY not in this_try:
                raise
            time.sleep(30)
    raise AssertionError("unreachable")


def _layout(server: LaunchedServer) -> Any:
    with urllib.request.urlopen(server.url + "/get_hicache_l3_cache_layout", timeout=60) as r:
        return json.load(r)


def _serve_twice(server: LaunchedServer, run: Run, text: str) -> None:
    server.wait_ready(START_TIMEOUT_S)
    run.replies += [server.generate(text), server.generate(text)]
    run.layouts.append(_layout(server))


def _stored_files(directory: Path) -> int:
    return sum(1 for p in directory.rglob("*") if p.is_file()) if directory.exists() else 0


def _wait_files(directory: Path, n: int, timeout: float = 120.0) -> int:
    import time

    deadline = time.monotonic() + timeout
    while _stored_files(directory) < n and time.monotonic() < deadline:
        time.sleep(0.5)
    return _stored_files(directory)


def _session(model: Path, tmp: Path, name: str, config: str, pythonpath: Path | None,
             text: str) -> Run:
    """One configuration on one SGLang (the reference tree, or the installed wheel)."""
    run = Run()
    store = tmp / f"{name}-file-l3"
    extra = {"hicache": HICACHE, "radix": [], "file": _file_l3(store)}[config]
    for start in range(2 if config == "file" else 1):
        log = tmp / f"{name}-{config}-{start}.log"
        run.logs.append(log)
        server = _start(model, extra, log, pythonpath)
        try:
            _serve_twice(server, run, text)
            if config == "file" and start == 0:     # the write-back lands before the restart
                pages = full_pages(run.replies[0].prompt_tokens) // PAGE
                assert _wait_files(store, pages) >= pages, server.tail()
        finally:
            server.stop(grace=30)
    return run


def _pair(model: Path, tmp: Path, reference: Path, config: str, text: str
          ) -> tuple[Run, Run]:
    """(reference, patched) runs of `config`, one server at a time: a HiCache server wants its
    pool plus SGLang's 10 GiB reserve free (pool_host/base.py), so two at once fail on 24 GiB."""
    return (_session(model, tmp, "reference", config, reference, text),
            _session(model, tmp, "patched", config, None, text))


def _tails(*runs: Run) -> str:
    out = []
    for run in runs:
        for log in run.logs:
            lines = log.read_text(errors="replace").splitlines() if log.exists() else []
            out.append(f"--- {log} ---\n" + "\n".join(lines[-40:]))
    return "\n".join(out)


@pytest.fixture(scope="module")
def text() -> str:
    return prompt(TOKENS, 30)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory, demo_model: Path, reference_tree: Path,
           text: str) -> Callable[[str], tuple[Run, Run]]:
    """config -> (reference run, patched run), each configuration run once per module."""
    done: dict[str, tuple[Run, Run] | BaseException] = {}

    def get(config: str) -> tuple[Run, Run]:
        if config not in done:
            tmp = tmp_path_factory.mktemp(config)
            try:
                done[config] = _pair(demo_model, tmp, reference_tree, config, text)
            except BaseException as e:   # noqa: BLE001 - reported by each test that needs it
                done[config] = e
                logs = sorted(tmp.glob("*.log"))
                sys.stderr.write("\n".join(f"--- {p} ---\n" + "\n".join(
                    p.read_text(errors="replace").splitlines()[-40:]) for p in logs))
        result = done[config]
        if isinstance(result, BaseException):
            raise result
        return result

    return get


def _assert_same_as_reference(ref: Run, ours: Run) -> None:
    assert ours.answers() == ref.answers(), _tails(ref, ours)
    assert ours.layouts == ref.layouts, (ours.layouts, ref.layouts)


def _assert_l1_hit(run: Run, first: int, second: int) -> None:
    a, b = run.replies[first], run.replies[second]
    assert b.output_ids == a.output_ids and b.text == a.text
    assert b.cached_tokens == full_pages(a.prompt_tokens), (b.cached_tokens, b.details)


def test_a_hicache_without_storage_serves_as_upstream(matrix) -> None:
    ref, ours = matrix("hicache")
    _assert_same_as_reference(ref, ours)
    _assert_l1_hit(ours, 0, 1)
    assert ours.replies[0].cached_tokens == 0
    assert ours.layouts[0]["enabled"] is False and ours.layouts[0]["backend"] is None


def test_b_hicache_with_the_stock_file_l3_across_a_restart(matrix) -> None:
    ref, ours = matrix("file")
    _assert_same_as_reference(ref, ours)
    _assert_l1_hit(ours, 0, 1)
    after = ours.replies[2]                       # the restarted server's first request
    assert after.output_ids == ours.replies[0].output_ids
    assert after.cached_tokens == full_pages(after.prompt_tokens), after
    assert after.details.get("storage", 0) > 0, after.details
    _assert_l1_hit(ours, 2, 3)
    assert all(la["backend"] == "file" and la["enabled"] is False for la in ours.layouts)


def test_c_plain_radix_cache_serves_as_upstream(matrix) -> None:
    ref, ours = matrix("radix")
    _assert_same_as_reference(ref, ours)
    _assert_l1_hit(ours, 0, 1)


def test_d_ours_gives_the_same_greedy_output(matrix, demo_model: Path, text: str,
                                             tmp_path: Path) -> None:
    ref, _ = matrix("radix")
    port = free_port()
    # the matrix's servers run SGLang's default (bf16) lm head: ours too, to compare tokens
    cfg = deployment(tmp_path / "ours.yaml", demo_model, port, tmp_path / "store",
                     {"enable-fp32-lm-head": False})
    log = tmp_path / "ours.log"
    server = _ready(lambda: LaunchedServer.start(cfg, log, f"http://127.0.0.1:{port}",
                                                 env={"UCX_MODULES": "^ib"}), log)
    try:
        replies = [server.generate(text), server.generate(text)]
    except BaseException:
        sys.stderr.write(server.tail(60))
        raise
    finally:
        server.stop(grace=30)
    for r in replies:
        assert (r.output_ids, r.text) == (ref.replies[0].output_ids, ref.replies[0].text)
    assert replies[1].cached_tokens == full_pages(replies[0].prompt_tokens)


def test_every_configuration_gives_the_same_tokens(matrix) -> None:
    tokens = {(config, who, i): tuple(r.output_ids)
              for config in ("hicache", "file", "radix")
              for who, run in zip(("reference", "patched"), matrix(config))
              for i, r in enumerate(run.replies)}
    assert len(set(tokens.values())) == 1, tokens
