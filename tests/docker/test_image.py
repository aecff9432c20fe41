"""Build docker/Dockerfile with buildah (no Docker engine here) on a local stand-in for the
SGLang base image, then run the entrypoint inside the image: `detect`, then `launch --dry-run`.

The stand-in (tests/docker/image_tools.py) has Python and a few of SGLang's dependencies but no
torch, so SGLang's parser cannot import inside it: launch checks the sglang: section with the
pinned parser's snapshot, which the smoke test asserts. The build stage really downloads the
pinned SGLang wheel (sha256-checked) and patches it, and resolves every path's dependencies from
PyPI as wheels (kvikio-cu13, NIXL, msgspec, redis-py, prometheus-client: distro/path_wheels.py);
the runtime stage installs them --no-deps --no-index, and the image imports every path module.
The stand-in base is built once and cached under /var/cache/sglang-offload-test; buildah's
storage lives in a temporary directory removed at the end.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from tests.distro.conftest import load_script
from tests.docker.image_tools import HOST_CA, Buildah, ensure_base_tar, tools_missing

REPO = Path(__file__).resolve().parents[2]
BASE = "localhost/sglang-offload-test-base:latest"
IMAGE = "localhost/sglang-offload:test"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(tools_missing() is not None, reason=str(tools_missing()))]


@pytest.fixture(scope="module")
def image() -> Buildah:
    tar = ensure_base_tar()
    work = Path(tempfile.mkdtemp(prefix="sglang-offload-buildah-", dir="/var/tmp"))
    b = Buildah(work)
    try:
        b.import_base(tar, BASE)
        b("bud", "--isolation", "chroot", "--pull=never", "--format", "docker",
          "--layers=false", "--build-arg", f"BASE={BASE}",
          "--ignorefile", str(REPO / "docker" / "Dockerfile.dockerignore"),
          "-v", f"{HOST_CA}:{HOST_CA}:ro",
          "-t", IMAGE, "-f", str(REPO / "docker" / "Dockerfile"), str(REPO), timeout=900)
        yield b
    finally:
        b.remove()


def run_in(b: Buildah, *cmd: str, env: dict[str, str] | None = None,
           config: Path | None = None) -> str:
    ctr = b("from", "--pull=never", IMAGE).stdout.strip()
    try:
        if config is not None:
            b("copy", ctr, str(config), "/etc/sglang-offload/config.yaml")
        envs = [x for k, v in (env or {}).items() for x in ("--env", f"{k}={v}")]
        res = b("run", "--isolation", "chroot", *envs, ctr, "--", *cmd, check=False)
        assert res.returncode == 0, f"{cmd}: {res.returncode}\n{res.stdout}\n{res.stderr}"
        return res.stdout
    finally:
        b("rm", ctr)


def test_image_metadata(image: Buildah) -> None:
    info = json.loads(image("inspect", "--type", "image", IMAGE).stdout)
    cfg = info["Docker"]["config"]
    assert cfg["Entrypoint"] == ["/usr/local/bin/sglang-offload-entrypoint"]
    assert "/var/cache/sglang-offload" in cfg["Volumes"]
    assert "/health" in " ".join(cfg["Healthcheck"]["Test"])
    assert "SGLANG_OFFLOAD_CONFIG=/etc/sglang-offload/config.yaml" in cfg["Env"]


def test_patched_sglang_and_our_package_are_installed(image: Buildah) -> None:
    out = run_in(image, "python3", "-c",
                 "import importlib.metadata as m, importlib.util as u, pathlib; "
                 "print(m.version('sglang')); print(m.version('sglang-offload')); "
                 "p = pathlib.Path(u.find_spec('sglang').origin).parent; "
                 "print('\"offload\"' in (p / 'srt/arg_groups/fields/memory.py').read_text()); "
                 "print(pathlib.Path('/tmp/wheels').exists())")
    bw = load_script(REPO / "distro" / "build_wheel.py", "sglang_offload_build_wheel")
    wheel = f"{bw.load_pin().version}+{bw.local_version()}"
    assert out.split() == [wheel, "0.1.0", "True", "False"]


PATH_MODULES = ("kvikio", "nixl", "msgspec", "redis", "prometheus_client")


def test_every_path_module_imports_in_the_image(image: Buildah) -> None:
    """kvikio imports without a GPU (libkvikio loads the CUDA driver only when first used), so
    the import itself is asserted, not only the metadata."""
    out = run_in(image, "python3", "-c",
                 "import importlib, importlib.util, importlib.metadata as m\n"
                 f"for name in {PATH_MODULES!r}:\n"
                 "    mod = importlib.import_module(name)\n"
                 "    print(name, mod.__name__ == name)\n"
                 "for d in ('kvikio-cu13', 'libkvikio-cu13', 'nixl', 'nixl-cu13', 'msgspec', 'redis',"
                 " 'prometheus-client'):\n"
                 "    print('dist:' + d, m.version(d))\n"
                 "print('cupy', importlib.util.find_spec('cupy') is not None)")
    lines = dict(ln.split(" ", 1) for ln in out.strip().splitlines())
    for name in PATH_MODULES:
        assert lines[name] == "True", out
    assert lines["dist:kvikio-cu13"].startswith("26.") and lines["dist:nixl"].startswith("1.")
    assert lines["cupy"] == "False"        # left out on purpose (distro/path_wheels.py)


def test_detect_reports_every_path_s_python_side_present(image: Buildah) -> None:
    out = json.loads(run_in(image, "sglang-offload", "detect", "--json", "--python", "python3"))
    side = out["facts"]["python"]
    assert side["status"] == "ok", side
    assert {p["path"]: p["present"] for p in side["paths"]} == dict.fromkeys(
        ("gds", "dpu", "redis", "metrics"), True), side["paths"]


def test_entrypoint_detects_then_dry_runs_launch(image: Buildah, tmp_path: Path) -> None:
    cfg = tmp_path / "cpu-dev.yaml"     # a model directory the image has (launch checks it)
    cfg.write_text((REPO / "configs" / "cpu-dev.yaml").read_text().replace(
        "/tmp/sglang-offload-demo", "/tmp"))
    out = run_in(image, "/usr/local/bin/sglang-offload-entrypoint", "--port", "30001",
                 env={"DRY_RUN": "1"}, config=cfg)
    assert out.index("sglang-offload detect: this machine") < out.index("sglang-offload launch:")
    assert "path: cpu" in out
    assert "checked with snapshot of SGLang 0.5.23's parser" in out
    command = out.rstrip().splitlines()[-1]
    assert "python3 -m sglang.launch_server --model-path /tmp " in command
    assert "--hicache-storage-backend dynamic" in command and command.endswith("--port 30001")


def test_health_check_command_probes_health(image: Buildah) -> None:
    """The image's HEALTHCHECK command, run inside the image against a stand-in /health."""
    info = json.loads(image("inspect", "--type", "image", IMAGE).stdout)
    kind, check = info["Docker"]["config"]["Healthcheck"]["Test"]
    assert kind == "CMD-SHELL"
    script = ("mkdir -p /tmp/h && cd /tmp/h && echo ok > health && "
              "(python3 -m http.server 30917 --bind 127.0.0.1 >/dev/null 2>&1 & "
              "echo $! > /tmp/pid) "
              "&& for i in 1 2 3 4 5 6 7 8 9 10; do sleep 0.3; " + check + " && break; done; "
              + check + "; ok=$?; rm health; " + check + "; gone=$?; kill $(cat /tmp/pid); "
              "echo \"ok=$ok gone=$gone\"")
    out = run_in(image, "sh", "-c", script, env={"SGLANG_OFFLOAD_PORT": "30917"})
    assert out.split()[-2:] == ["ok=0", "gone=1"]
