"""distro/install_patched.py: installs the patched wheel only when the interpreter's SGLang is stale.

`--check` in the scratch venv that holds the wheel built from patches/series reports it current
(exit 0); in an empty venv it reports "not installed" (exit 1). A run where the wheel is current
prints nothing and builds nothing (scripts/install.sh runs it every time).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "distro" / "install_patched.py"


def _run(python: Path | str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), str(SCRIPT), *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def test_current_wheel_is_reported_and_left_alone(bw, patched_site):
    python = patched_site.parents[2] / "bin" / "python"
    version = f"{bw.load_pin().version}+{bw.local_version()}"
    check = _run(python, "--check")
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"sglang {version} with this patches/series is installed" in check.stdout
    quiet = _run(python, "--out", "/nonexistent/never-built")
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")


def test_a_venv_without_the_wheel_is_stale(tmp_path):
    venv = tmp_path / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    check = _run(venv / "bin" / "python", "--check")
    assert check.returncode == 1
    assert "stale: not installed" in check.stdout
