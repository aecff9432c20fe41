"""A stalled L3 tier costs a request at most launch's prefetch deadline, then it is a miss (issue 35).

A real SGLang server, started through `sglang-offload launch` on the CPU, on the dpu path: its L3
is a real agent process on loopback (`sglang-offload agent --memory`). A cold prompt is written
back to the agent; after SGLang's `/flush_cache` empties L1/L2 the same prompt is an L3 hit (a
working tier loads everything inside the deadline). Then the agent is SIGSTOPped (a hung DPU:
its socket accepts, nothing answers) and L1/L2 are flushed again: the same prompt completes,
with the same greedy tokens, none of them from storage, while the agent is still stopped. The
agent client's own timeout is set far past the request's read timeout, so only SGLang's
deadline (policy timeout, launch's `prefetch_timeout_*` keys) can have let it through; under
`wait_complete`, launch's former pick on CPU, it waited for the agent. No wall clock is
asserted: the read timeout is the test's bound.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Callable

import pytest

from offload.launch.server import LaunchedServer
from tests.e2e.conftest import (
    PAGE,
    assert_agrees,
    flush_l1_l2,
    full_pages,
    needs_serving,
    prompt,
    wait_metric,
)

pytestmark = [needs_serving, pytest.mark.timeout(1200)]
TOKENS = 1200
AGENT_TIMEOUT_S = 600     # the backend's own bound on one agent request: past READ_TIMEOUT_S
READ_TIMEOUT_S = 240      # the stalled request must answer within this (no byte for longer fails)
CAP_S = 120               # launch's cap: 7.5 s per 1K tokens at the 16K context, ~9 s here



def test_a_stopped_agent_is_a_miss_within_the_deadline_with_the_same_output(
        servers: Callable[..., LaunchedServer], tmp_path: Path, demo_model: Path) -> None:
    from tests.agent.conftest import SECRET, AgentProc, needs_nixl

    if needs_nixl.args[0]:
        pytest.skip(needs_nixl.kwargs["reason"])
    agent = AgentProc(tmp_path, ["--memory"]).start()
    stopped = False
    try:
        hosts = Path(__file__).resolve().parents[1] / "fixtures" / "hosts" / "h100-bf3-dpu"
        s = servers(tmp_path / "unused", name="stall", launch_args=("--root", str(hosts)),
                    env={"SGLANG_OFFLOAD_SECRET": SECRET.decode()}, transfer={"path": "dpu"},
                    agent={"address": agent.address, "transport": "ucx",
                           "timeout_s": AGENT_TIMEOUT_S},
                    worth_it={"max_prefetch_wait_s": CAP_S})
        assert "prefetch_timeout_per_ki_token" in s.log.read_text()   # launch's deadline keys
        text = prompt(TOKENS, 35)
        cold = s.generate(text)
        assert cold.cached_tokens == 0
        pages = full_pages(cold.prompt_tokens) // PAGE
        assert wait_metric(s, "sglang_offload_pool_pages_total", 'direction="write"',
                           pages) >= pages
        flush_l1_l2(s)
        hit = s.generate(text)                               # from the agent, inside the deadline
        assert_agrees(cold, hit, "the agent's hit", demo_model)
        assert hit.cached_tokens == full_pages(cold.prompt_tokens), hit
        assert hit.details.get("storage", 0) > 0, hit.details
        flush_l1_l2(s)
        os.kill(agent.proc.pid, signal.SIGSTOP)              # the tier hangs
        stopped = True
        miss = s.generate(text, timeout=READ_TIMEOUT_S)
        assert agent.proc.poll() is None                     # still there, still stopped
        assert_agrees(cold, miss, "the miss while the agent is stopped", demo_model)
        assert miss.details.get("storage", 0) == 0, miss.details
        assert miss.cached_tokens == 0, miss
        print(f"stalled tier: answered in {miss.total_s:.1f} s (deadline "
              f"{(cold.prompt_tokens - 1) // PAGE * PAGE / 1024 * CAP_S * 1024 / 16384:.1f} s "
              f"for its pages); cold {cold.total_s:.1f} s, L3 hit {hit.total_s:.1f} s")
    finally:
        if stopped:
            os.kill(agent.proc.pid, signal.SIGCONT)
        agent.stop()
