"""What launch picks on the device SGLang is given, and the interpreter check of `--python`."""

from __future__ import annotations

import os
from pathlib import Path

from offload.launch.interpreter import check_interpreter, pinned
from tests.launch.helpers import HOSTS, dry_run, run_cli, write

PYTHONS = HOSTS.parent / "pythons"
CPU = "sglang:\n  model-path: m\n  device: cpu\n  page-size: 64\noffload:\n  store: {path: /tmp/x}\n"


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_cpu_device_gets_what_works_there(capsys, tmp_path: Path) -> None:
    out = dry_run(capsys, write(tmp_path, CPU), root=str(HOSTS / "cpu-box"))
    argv = out["argv"]
    assert _flag(argv, "--attention-backend") == "torch_native"
    assert _flag(argv, "--cuda-graph-backend-decode") == "disabled"
    assert _flag(argv, "--cuda-graph-backend-prefill") == "disabled"
    assert _flag(argv, "--hicache-io-backend") == "kernel"
    assert _flag(argv, "--hicache-mem-layout") == "page_first"
    # SGLang's default policy, timeout, stays: a bounded wait (tests/launch/test_prefetch_bound.py)
    assert _flag(argv, "--hicache-storage-prefetch-policy") is None
    assert out["device"]["env"] == {"SGLANG_USE_CPU_ENGINE": "1"}
    assert out["command"].startswith("SGLANG_USE_CPU_ENGINE=1 ")
    assert any("intel_amx" in r for r in out["device"]["reasons"])


def test_a_key_the_user_set_is_named_not_overridden(capsys, tmp_path: Path) -> None:
    cfg = write(tmp_path, CPU.replace("  page-size: 64\n", "  page-size: 64\n  attention-backend: "
                                       "intel_amx\n"))
    out = dry_run(capsys, cfg, "--", "--hicache-storage-prefetch-policy", "timeout",
                  root=str(HOSTS / "cpu-box"))
    argv = out["argv"]
    assert argv.count("--attention-backend") == 1 and _flag(argv, "--attention-backend") == "intel_amx"
    assert argv.count("--hicache-storage-prefetch-policy") == 1
    assert _flag(argv, "--hicache-storage-prefetch-policy") == "timeout"
    assert any(r.startswith("--attention-backend intel_amx: set in the config")
               for r in out["device"]["reasons"])


def test_gpu_device_keeps_sglang_defaults(capsys, tmp_path: Path) -> None:
    out = dry_run(capsys, write(tmp_path, CPU.replace("device: cpu", "device: cuda")))
    assert out["device"]["argv"] == [] and out["device"]["env"] == {}
    assert "--attention-backend" not in out["argv"] and "SGLANG_USE_CPU_ENGINE" not in out["command"]


def test_python_without_sglang_or_offload_is_refused(capsys, tmp_path: Path) -> None:
    rc, out, err = run_cli(capsys, "launch", "--config", str(write(tmp_path, CPU)), "--dry-run",
                           "--root", str(HOSTS / "cpu-box"), "--python", str(PYTHONS / "bare"))
    assert rc == 1 and out == ""
    sg, ours = pinned()
    from offload.hw.pyside import checkout

    assert err == [f"error: --python {PYTHONS / 'bare'} cannot import sglang {sg} and "
                   f"sglang-offload {ours}; install both into it as docs/install.md does "
                   f"(`{PYTHONS / 'bare'} -m pip install -e '{checkout()}[sglang]'`, then the "
                   f"patched SGLang wheel: `{PYTHONS / 'bare'} {checkout()}/distro/"
                   "install_patched.py`) or pass --python EXE: the interpreter that has both"]


def test_python_at_other_versions_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho '{\"sglang\": {\"found\": true, \"version\": \"0.5.9\"}, "
                    "\"offload\": {\"found\": true, \"version\": \"" + pinned()[1] + "\"}}'\n")
    fake.chmod(0o755)
    got = check_interpreter(str(fake))
    assert got.problem is not None and "has sglang 0.5.9 (pinned 0.5.23)" in got.problem
    assert check_interpreter(str(tmp_path / "missing")).problem.startswith(
        f"--python {tmp_path / 'missing'}: cannot ask it what it imports")
    assert check_interpreter(str(PYTHONS / "all-cu13")).problem is None


def test_the_probe_ignores_the_working_directory(tmp_path: Path) -> None:
    """A checkout's own sglang_offload.egg-info next to the caller is not the interpreter's."""
    (tmp_path / "offload").mkdir()
    (tmp_path / "offload" / "__init__.py").write_text("")
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        got = check_interpreter(str(PYTHONS / "bare"))
    finally:
        os.chdir(old)
    assert got.offload is None and got.sglang is None


def test_a_real_launch_says_its_decision_then_execs_with_the_device_env(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    from tests.launch.helpers import REPO

    fake = tmp_path / "python"      # answers the interpreter probe, then shows what SGLang got
    probe = json.dumps({"sglang": {"found": True, "version": pinned()[0]},
                        "offload": {"found": True, "version": pinned()[1]}})
    fake.write_text(f"#!/bin/sh\n[ \"$1\" = -c ] && echo '{probe}' && exit 0\n"
                    'echo "env=$SGLANG_USE_CPU_ENGINE"\n')
    fake.chmod(0o755)
    cfg = write(tmp_path, CPU.replace("/tmp/x", str(tmp_path / "store")))
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    res = subprocess.run([sys.executable, "-m", "offload.cli", "launch", "--config", str(cfg),
                          "--root", str(HOSTS / "cpu-box"), "--python", str(fake)],
                         capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "env=1\n"
    err = [ln for ln in res.stderr.splitlines() if not ln.startswith("warning: ")]
    assert err[0] == f"sglang-offload launch: {cfg}"
    assert err[1].startswith("  path: cpu (requested auto): ")
    assert err[2].startswith(f"  store: {tmp_path / 'store'} (capacity ")
    assert err[3] == f"  tiers: L1 cpu KV pool (SGLang) -> L2 host pool (HiCache) -> L3 store " \
                     f"{tmp_path / 'store'}"
    assert "attention-backend torch_native" in err[4] and err[-2].startswith("  exec: SGLANG_USE")
    assert err[-1].startswith("  page-hash extension hicache_hash_cpp: ")
