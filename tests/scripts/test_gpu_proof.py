"""scripts/gpu-wheels.sh + scripts/gpu-proof.sh end to end in their dry mode on this CPU machine:
the wheels are downloaded (a few MB from PyPI; skipped with the reason if it is unreachable),
installed with --no-index into a target directory, kvikio imports from there, the GPU parts are
skipped with the reason, and scripts/gpu_proof.py runs its whole pipeline on a tiny model."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"


def _load_proof():
    spec = importlib.util.spec_from_file_location("gpu_proof", SCRIPTS / "gpu_proof.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_proof"] = mod             # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("whl")
    res = subprocess.run(["bash", str(SCRIPTS / "gpu-wheels.sh"), str(dest)], capture_output=True,
                         text=True, timeout=600)
    if res.returncode != 0:
        pytest.skip(f"gpu-wheels.sh could not download from PyPI (unreachable?): "
                    f"{res.stderr.strip()[-300:]}")
    return dest


def test_wheels_are_the_few_the_proof_needs(wheels: Path) -> None:
    names = sorted(p.name.split("-")[0] for p in wheels.glob("*.whl"))
    assert names == ["cuda_pathfinder", "kvikio_cu13", "libkvikio_cu13", "packaging",
                     "rapids_logger"]
    assert sum(p.stat().st_size for p in wheels.glob("*.whl")) <= 48 << 20


def test_gpu_proof_dry_run_end_to_end(wheels: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "WHEELS": str(wheels), "OUT": str(out), "TARGET": str(tmp_path / "site"),
           "CACHE_DIR": str(tmp_path / "store"), "PYTHON": str(REPO / ".venv" / "bin" / "python")}
    if not Path(env["PYTHON"]).exists():
        env.pop("PYTHON")
    h200 = REPO / "configs" / "llama-3.1-8b-128k-h200.yaml"      # a GPU host's file, unchanged
    res = subprocess.run(["bash", str(SCRIPTS / "gpu-proof.sh"), "--dry-run", "--config",
                          str(h200), "--workload"], capture_output=True, text=True, timeout=900,
                         env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "gpu-proof: kvikio 26." in res.stdout
    assert "skip: the gpu-marked tests (--dry-run: no GPU)" in res.stdout
    # the deployment file is checked and shown as the SGLang command and bench serve's command
    assert "-m sglang.launch_server --model-path meta-llama/Llama-3.1-8B-Instruct" in res.stdout
    assert (f"skip: bench serve (--dry-run); on the GPU machine: {env.get('PYTHON', 'python3')} "
            f"-m offload.cli bench serve --config {h200} --lengths 8192,32768,131008") in res.stdout
    assert (f"skip: bench serve-fp8 (--dry-run); on the GPU machine: "
            f"{env.get('PYTHON', 'python3')} -m offload.cli bench serve --config {h200} "
            "--lengths 131008 --repeat 3 --kv-cache-dtype fp8_e4m3") in res.stdout
    assert (f"skip: bench workload (--dry-run); on the GPU machine: {env.get('PYTHON', 'python3')} "
            f"-m offload.cli bench workload --config {h200} --groups 8 --users 8 --turns 3 "
            "--prefix-tokens 32768") in res.stdout
    assert (tmp_path / "site" / "kvikio").is_dir()
    result = json.loads((out / "gpu-proof.json").read_text())
    assert result["dry_run"] is True and result["gds"]["skipped"] == "dry run: no GPU"
    assert [r["tokens"] for r in result["results"]] == [256, 512, 1024]
    assert all(r["prefill_s"] > 0 and r["cpu_staging_s"] > 0 for r in result["results"])
    assert (out / "gpu-proof.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "store").exists()                # the store is removed at the end


def test_png_writer_without_matplotlib(tmp_path: Path) -> None:
    import zlib

    proof = _load_proof()
    rows = [{"tokens": 32768, "prefill_s": 1.5, "cpu_staging_s": 0.5, "gds_s": 0.3}]
    png = tmp_path / "p.png"
    assert proof._png_bars(rows, [("prefill_s", "a"), ("cpu_staging_s", "b"), ("gds_s", "c")],
                           png) == "minimal PNG writer"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    idat = data.index(b"IDAT")
    length = int.from_bytes(data[idat - 4:idat], "big")
    raw = zlib.decompress(data[idat + 4:idat + 4 + length])
    assert len(raw) == 240 * (1 + 480 * 3)


def test_llama_8b_shape_and_kv_bytes() -> None:
    proof = _load_proof()
    shape = proof.LLAMA_8B
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads) == (32, 4096, 32, 8)
    assert shape.kv_bytes_per_token(2) == 128 << 10          # 128 KiB per token in bf16


def _serve_result(dtype: str, block: int, cold: float, l3: float, same: bool) -> dict:
    return {"server": {"kv_cache_dtype": dtype}, "store": {"blocks": 4, "data_bytes": 4 * block},
            "rows": {"131008": {"cold": {"ttft_s": cold},
                                "l3": {"ttft_s": l3, "same_output": same}}}}


def test_fp8_summary_sets_bf16_and_fp8_side_by_side(tmp_path: Path) -> None:
    bf16 = tmp_path / "bf16.json"
    fp8 = tmp_path / "fp8.json"
    bf16.write_text(json.dumps(_serve_result("auto", 131072, 12.0, 6.0, True)))
    fp8.write_text(json.dumps(_serve_result("fp8_e4m3", 65536, 12.0, 3.0, False)))
    res = subprocess.run([sys.executable, str(SCRIPTS / "gpu_proof.py"), "--fp8-summary",
                          str(bf16), str(fp8), "--tokens", "131008"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "fp8 KV cache vs bf16 at 131008 tokens (fp8_e4m3 vs auto" in out
    assert "L3 bytes per block 131072 vs 65536 (fp8/bf16 0.50x)" in out
    assert "cold TTFT 12.000 s vs 12.000 s (fp8/bf16 1.00x)" in out
    assert "L3 hit TTFT 6.000 s vs 3.000 s (fp8/bf16 0.50x)" in out
    assert "L3 hit gives its own cold output: bf16 yes, fp8 NO" in out
    # a length neither ran: dashes, no ratio, no traceback
    lines = _load_proof().fp8_summary({}, {}, 8192)
    assert lines[2] == "  cold TTFT - vs -"


@pytest.mark.parametrize("argv,expected", [
    (["--config"], "--config needs a FILE"),
    (["--config", "/nonexistent.yaml"], "--config /nonexistent.yaml: no such file"),
    (["--fast"], "unknown argument --fast"),
    (["--workload"], "--workload needs --config FILE"),
    (["--unique"], "--unique needs --config FILE"),
])
def test_gpu_proof_bad_arguments_are_one_error_line(argv: list[str], expected: str,
                                                     tmp_path: Path) -> None:
    res = subprocess.run(["bash", str(SCRIPTS / "gpu-proof.sh"), *argv], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 2 and expected in res.stderr, res.stderr
