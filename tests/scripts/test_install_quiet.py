"""scripts/install.sh hides pip's "sglang 0.5.23 requires X, which is not installed" lines (SGLang
is installed --no-deps on purpose) and keeps every other line: its `quiet_pip` run here against a
stand-in pip that prints what pip prints."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

INSTALL = Path(__file__).resolve().parents[2] / "scripts" / "install.sh"
PIP_STDERR = """\
ERROR: pip's dependency resolver does not currently take into account all the packages that are installed. \
This behaviour is the source of the following dependency conflicts.
sglang 0.5.23 requires aiohttp, which is not installed.
sglang 0.5.23 requires kernels<0.15,>=0.14.1, which is not installed.
sglang 0.5.23 requires torch==2.14.1, but you have torch 2.9.0 which is incompatible.
"""


def test_quiet_pip_hides_only_the_deliberate_lines(tmp_path: Path) -> None:
    text = INSTALL.read_text()
    body = re.search(r"^hidden=.*?^}\n", text, re.M | re.S)
    assert body, "install.sh has no quiet_pip"
    (tmp_path / "err.txt").write_text(PIP_STDERR)
    script = (f'pip=(sh -c \'cat "$0" >&2; exit 3\' {tmp_path / "err.txt"})\n' + body.group(0)
              + 'quiet_pip; echo "rc=$?"; sort -u "$hidden" | wc -l\n')
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert res.stdout.split() == ["rc=3", "2"]          # pip's exit code is kept
    assert res.stderr.splitlines() == PIP_STDERR.splitlines()[:1] + PIP_STDERR.splitlines()[3:]
