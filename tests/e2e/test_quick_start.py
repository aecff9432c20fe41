"""The README's quick start, run verbatim: a real answer twice, the second from L3.

The quick start's shell block is taken from README.md as it is and run by bash, as a user pastes
it, in namespaces of its own (`unshare`: a private /tmp on tmpfs, its own loopback network and
process tree), so port 30000 and /tmp/sglang-offload* are its own whatever else runs on the box,
and every process it leaves (a server the block's last `kill` only signals) is gone with it.
Each `ask` prints prompt tokens, cached tokens, SGLang's breakdown and the answer; the lines it
prints must be the ones the README shows after `ask  #` (the model is deterministic: greedy, a
CPU), the first computed (nothing cached), the second after the restart from storage with the
same answer.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import PAGE, needs_serving

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def quick_start() -> tuple[str, list[str]]:
    """The quick start's shell block, and the output each `ask` line documents."""
    text = README.read_text()
    section = text[text.index("## Quick start"):]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, "README.md's quick start has no ```sh block"
    script = block.group(1)
    shown = [m.group(1).strip() for m in re.finditer(r"^ask\s+#\s*(.+)$", script, re.M)]
    return script, shown


def parse(line: str) -> tuple[int, int, dict | None, str]:
    """`2264 0 None 'text'` -> (prompt tokens, cached tokens, breakdown, answer)."""
    prompt, cached, rest = line.split(" ", 2)
    if rest.startswith("None "):
        details, answer = None, rest[5:]
    else:
        end = rest.index("} ") + 1
        details, answer = ast.literal_eval(rest[:end]), rest[end + 1:]
    return int(prompt), int(cached), details, ast.literal_eval(answer)


def test_the_readme_documents_two_asks() -> None:
    script, shown = quick_start()
    assert script.count("\nask ") == 2 and len(shown) == 2, shown
    first, second = parse(shown[0]), parse(shown[1])
    assert first[1] == 0 and second[1] == (first[0] - 1) // PAGE * PAGE
    assert second[2] is not None and second[2]["storage"] == second[1]
    assert first[3] == second[3] and len(first[3].split()) >= 4, "a real sentence, twice"


@needs_serving
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_the_quick_start_verbatim_answers_twice_the_second_from_l3(tmp_path: Path) -> None:
    script, shown = quick_start()
    wrapper = ("set -e; mount -t tmpfs -o size=8g none /tmp; ip link set lo up; "
               f"cd {ROOT}; exec bash -c \"$QUICK_START\"")
    t0 = time.monotonic()
    run = subprocess.run(["unshare", "--mount", "--net", "--pid", "--fork", "--mount-proc",
                          "--propagation", "private", "bash", "-c", wrapper],
                         env={**os.environ, "QUICK_START": script},
                         capture_output=True, text=True, timeout=900)
    took = time.monotonic() - t0
    (tmp_path / "quick-start.out").write_text(run.stdout + "\n--- stderr ---\n" + run.stderr)
    printed = [ln.strip() for ln in run.stdout.splitlines()
               if re.match(r"^\d+ \d+ ", ln.strip())]
    assert run.returncode == 0 and len(printed) == 2, (
        f"rc {run.returncode} after {took:.0f} s\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    cold, hit = parse(printed[0]), parse(printed[1])
    assert cold[1] == 0, printed[0]
    assert hit[1] == (hit[0] - 1) // PAGE * PAGE and hit[2] and hit[2]["storage"] == hit[1], (
        printed[1])
    assert hit[3] == cold[3], printed
    assert printed == shown, f"the README shows other lines than a run prints:\n{printed}"
