"""docker/Dockerfile read by a real Dockerfile parser (PyPI `dockerfile`, BuildKit's own), and
the entrypoint run on this machine (the image itself: test_image.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

dockerfile = pytest.importorskip("dockerfile")

from tests.launch.helpers import fake_python  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"


def commands() -> list:
    return list(dockerfile.parse_file(str(DOCKERFILE)))


def stages() -> dict[str, list]:
    out: dict[str, list] = {}
    name = None
    for c in commands():
        if c.cmd == "FROM":
            name = c.value[2] if len(c.value) == 3 and c.value[1].upper() == "AS" else None
            out[name] = []
        elif name is not None:
            out[name].append(c)
    return out


def test_base_is_the_pinned_sglang_release_and_every_arg_is_documented() -> None:
    pin = tomllib.loads((REPO / "distro" / "upstream.toml").read_text())
    first = commands()[0]
    want = f"BASE=lmsysorg/sglang:v{pin['sglang']['version']}"
    assert (first.cmd, first.value) == ("ARG", (want,))
    header = DOCKERFILE.read_text().split("\nARG ", 1)[0]
    for c in commands():
        if c.cmd == "ARG":
            name = c.value[0].split("=")[0]
            assert re.search(rf"^#\s+{name}\s", header, re.M), f"ARG {name} not documented"


def test_named_stages_runtime_last_on_the_base() -> None:
    froms = [c.value for c in commands() if c.cmd == "FROM"]
    assert froms == [("${BASE}", "AS", "build"), ("${BASE}", "AS", "runtime")]


def test_runtime_installs_built_wheels_only_no_tools_no_sed() -> None:
    runtime = stages()["runtime"]
    runs = [c for c in runtime if c.cmd == "RUN"]
    tools = re.compile(r"\b(apt-get|apt|gcc|g\+\+|make|cmake|build-essential|git|patch)\b")
    for c in commands():
        if c.cmd == "RUN":
            assert not re.search(r"\bsed\b", " ".join(c.value)), "no sed patching in RUN"
    for c in runs:
        assert not tools.search(" ".join(c.value)), c.value
    install = [c for c in runs if "pip install" in c.value[0]]
    assert len(install) == 1
    assert "--no-deps" in install[0].value[0] and "--no-index" in install[0].value[0]
    assert install[0].flags == ("--mount=type=bind,from=build,source=/wheels,target=/tmp/wheels",)
    assert not [c for c in runtime if c.cmd in ("COPY", "ADD") and "--from=build" in c.flags]


def test_build_stage_makes_both_wheels() -> None:
    run = " ".join(" ".join(c.value) for c in stages()["build"] if c.cmd == "RUN")
    assert "pip wheel --no-deps --wheel-dir /wheels ." in run
    assert "distro/build_wheel.py --out /wheels" in run
    assert "distro/path_wheels.py --cuda-major ${CUDA_MAJOR} --out /wheels" in run


def test_cuda_major_defaults_to_the_pinned_base_s_cuda_and_has_its_gds_extra() -> None:
    build = stages()["build"]
    (arg,) = [c.value[0] for c in build if c.cmd == "ARG" and c.value[0].startswith("CUDA_MAJOR")]
    major = arg.split("=")[1]
    assert major == "13"                          # lmsysorg/sglang:v0.5.23 is CUDA 13
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras[f"gds-cu{major}"] == extras["gds"] == ["kvikio-cu13>=25.10"]
    assert extras["gds-cu12"][0].startswith("kvikio-cu12")


def test_volume_health_check_entrypoint() -> None:
    by = {c.cmd: c for c in stages()["runtime"]}
    assert by["VOLUME"].value == ("/var/cache/sglang-offload",)
    assert by["HEALTHCHECK"].value[0] == "CMD" and "/health" in by["HEALTHCHECK"].value[1]
    assert by["ENTRYPOINT"].value == ("/usr/local/bin/sglang-offload-entrypoint",)
    copied = [c.value for c in stages()["runtime"] if c.cmd == "COPY"]
    assert ("docker/entrypoint.sh", "/usr/local/bin/sglang-offload-entrypoint") in copied


def run_entrypoint(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    return subprocess.run(["sh", str(ENTRYPOINT), *args], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300,
                          env={**os.environ, "PATH": path, "PYTHONPATH": str(REPO), **env})


def cpu_dev(tmp_path: Path) -> str:
    """configs/cpu-dev.yaml with its model directory here (launch refuses a missing one)."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    cfg = tmp_path / "cpu-dev.yaml"
    cfg.write_text((REPO / "configs" / "cpu-dev.yaml").read_text().replace(
        "/tmp/sglang-offload-demo", str(model)))
    return str(cfg)


def test_entrypoint_reports_then_dry_runs_launch(tmp_path: Path) -> None:
    res = run_entrypoint(tmp_path, "--port", "30001", DRY_RUN="1",
                         SGLANG_OFFLOAD_CONFIG=cpu_dev(tmp_path))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert out.index("sglang-offload detect: this machine") < out.index("sglang-offload launch:")
    command = out.rstrip().splitlines()[-1]
    assert f"-m sglang.launch_server --model-path {tmp_path / 'model'}" in command
    assert command.endswith("--port 30001")


def test_entrypoint_execs_launch_and_other_commands(tmp_path: Path) -> None:
    fake = fake_python(tmp_path / "fake-python", 'echo "sglang started: $*"\n')
    res = run_entrypoint(tmp_path, SGLANG_OFFLOAD_PYTHON=str(fake),
                         SGLANG_OFFLOAD_CONFIG=cpu_dev(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "sglang started: -m sglang.launch_server --model-path" in res.stdout
    res = run_entrypoint(tmp_path, "echo", "hello")
    assert (res.returncode, res.stdout) == (0, "hello\n")


@pytest.mark.slow   # ten entrypoint runs (about 10 s each on a loaded box); one stays quick below
@pytest.mark.parametrize("value, dry", [("1", True), ("true", True), ("YES", True), ("on", True),
                                        ("0", False), ("false", False), ("False", False),
                                        ("no", False), ("off", False), ("", False)])
def test_dry_run_reads_yes_and_no_words(tmp_path: Path, value: str, dry: bool) -> None:
    """DRY_RUN=false starts SGLang (it was a dry run: any value but 0 was)."""
    fake = fake_python(tmp_path / "fake-python", 'echo "sglang started: $*"\n')
    res = run_entrypoint(tmp_path, SGLANG_OFFLOAD_PYTHON=str(fake), DRY_RUN=value,
                         SGLANG_OFFLOAD_CONFIG=cpu_dev(tmp_path))
    assert res.returncode == 0, res.stderr
    assert ("sglang started:" not in res.stdout) == dry
    assert ("(dry run)" in res.stdout) == dry


def test_a_dry_run_value_that_is_no_yes_or_no_is_refused(tmp_path: Path) -> None:
    res = run_entrypoint(tmp_path, DRY_RUN="maybe", SGLANG_OFFLOAD_CONFIG=cpu_dev(tmp_path))
    assert res.returncode == 2 and "sglang started" not in res.stdout
    assert res.stderr.splitlines()[-1] == ("error: DRY_RUN='maybe' is not a yes/no value; use "
                                           "1/true/yes/on or 0/false/no/off")


def test_entrypoint_without_config_says_how_to_mount_one(tmp_path: Path) -> None:
    res = run_entrypoint(tmp_path, SGLANG_OFFLOAD_CONFIG=str(tmp_path / "missing.yaml"))
    assert res.returncode == 2
    assert res.stderr.startswith("error: no deployment config at ")
