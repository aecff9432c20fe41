"""The deployment against the machine (offload.launch.checks): one warnings list shared by
`detect` and `launch`, and what cannot run here refused by the dry run (one `error:` line, exit
2): a missing model directory, more GPUs than the host has, pinned L2 past its memory."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.launch.helpers import HOSTS, dry_run, run_cli, write

GIB = 1 << 30
BOX_70B = ("sglang:\n  model-path: meta-llama/Llama-3.1-70B-Instruct\n  tp-size: 8\n"
           "  page-size: 64\n  hicache-size: {size}\n")


def machine(tmp_path: Path, total: int, available: int, host: str = "dgx-8nvme") -> str:
    """A copy of a fixture machine whose /proc/meminfo says `total` / `available` bytes."""
    root = tmp_path / "host"
    shutil.copytree(HOSTS / host, root, symlinks=True)
    (root / "proc" / "meminfo").write_text(
        f"MemTotal:       {total // 1024} kB\nMemFree:        {available // 1024} kB\n"
        f"MemAvailable:   {available // 1024} kB\nBuffers:          1024 kB\n")
    return str(root)


def test_pinning_more_l2_than_the_box_has_is_refused(capsys, tmp_path: Path) -> None:
    """8 x 120 GB of hicache-size on a 23 GB box (the issue's dry run, which said nothing)."""
    root = machine(tmp_path, 23 * 10**9, 20 * 10**9)
    cfg = write(tmp_path, BOX_70B.format(size=120))
    rc, out, err = run_cli(capsys, "launch", "--config", str(cfg), "--dry-run", "--root", root)
    assert rc == 2 and out == "" and len(err) == 1, err
    assert err[0].startswith("error: sglang.hicache-size: 120 GB of pinned host memory per rank "
                             "× 8 ranks (tp-size 8) = 960 GB, but this host has 23.0 GB "
                             "(/proc/meminfo MemTotal) and SGLang keeps 10 GiB of it free")
    assert "lower hicache-size to at most 1 GB per rank" in err[0]


def test_l2_past_what_is_free_now_warns_and_what_fits_is_a_note(capsys, tmp_path: Path) -> None:
    root = machine(tmp_path, 2048 * GIB, 500 * GIB)
    out = dry_run(capsys, write(tmp_path, BOX_70B.format(size=120)), root=root)
    (warn,) = [w for w in out["warnings"] if w.startswith("sglang.hicache-size:")]
    assert "more than is free now" in warn and "SGLang refuses to start" in warn
    out = dry_run(capsys, write(tmp_path, BOX_70B.format(size=40)), root=root)
    assert not [w for w in out["warnings"] if "hicache-size" in w]
    assert any(n.startswith("sglang.hicache-size: 40 GB of pinned host memory per rank × 8 ranks")
               and "of 2,199.0 GB host memory" in n for n in out["notes"]), out["notes"]


def test_l2_with_dp_counts_every_rank_of_the_host(capsys, tmp_path: Path) -> None:
    root = machine(tmp_path, 100 * 10**9, 100 * 10**9)
    cfg = write(tmp_path, "sglang:\n  model-path: meta-llama/Llama-3.1-8B-Instruct\n"
                "  dp-size: 4\n  page-size: 64\n  hicache-size: 30\n")
    rc, _, err = run_cli(capsys, "launch", "--config", str(cfg), "--dry-run", "--root", root)
    assert rc == 2 and "× 4 ranks (tp-size 1 × dp-size 4) = 120 GB" in err[0], err


def test_tp_size_past_the_host_s_gpus_is_refused(capsys, tmp_path: Path) -> None:
    cfg = write(tmp_path, BOX_70B.format(size=0))
    for root, have in (("/", "0 GPUs"), (str(HOSTS / "h100-md-raid0"), "2 GPUs")):
        rc, out, err = run_cli(capsys, "launch", "--config", str(cfg), "--dry-run", "--root", root)
        assert rc == 2 and out == "" and len(err) == 1, err
        assert err[0].startswith(f"error: sglang.tp-size: tp-size 8 needs 8 GPUs on this host, "
                                 f"and it has {have}"), err
        assert "or set device: cpu" in err[0]
    # the real launch refuses it too, before anything starts
    rc, _, err = run_cli(capsys, "launch", "--config", str(cfg), "--root", str(HOSTS / "cpu-box"))
    assert rc == 2 and err[0].startswith("error: sglang.tp-size: tp-size 8 needs 8 GPUs")


@pytest.mark.parametrize("model", ["/models/llama-3.1-70b", "./weights", "../weights",
                                   "~/no-such-weights", "org/name/extra"])
def test_a_model_path_that_is_not_here_is_refused(capsys, tmp_path: Path, model: str) -> None:
    cfg = write(tmp_path, f"sglang:\n  model-path: {model}\n  device: cpu\n  page-size: 64\n")
    rc, out, err = run_cli(capsys, "launch", "--config", str(cfg), "--dry-run")
    assert rc == 2 and out == "" and err == [
        f"error: sglang.model-path: {model!r} does not exist on this machine, and it is not a "
        "HuggingFace id (ORG/NAME) either; put the weights there (or mount them), or fix the path"]


@pytest.mark.parametrize("model", ["meta-llama/Llama-3.1-8B-Instruct", "gpt2", "{tmp}"])
def test_a_huggingface_id_or_a_directory_here_passes(capsys, tmp_path: Path, model: str) -> None:
    model = model.format(tmp=tmp_path)
    cfg = write(tmp_path, f"sglang:\n  model-path: {model}\n  device: cpu\n  page-size: 64\n"
                f"offload:\n  store: {{path: {tmp_path / 'c'}}}\n")
    out = dry_run(capsys, cfg, root="/")
    assert out["argv"][out["argv"].index("--model-path") + 1] == model


def test_every_detect_warning_is_in_the_dry_run(capsys, tmp_path: Path) -> None:
    """The issue's case: a cache directory on the system's / file system (an unmounted /raid),
    which `detect` said and `launch --dry-run` did not (`"warnings": []`)."""
    cfg = write(tmp_path, f"sglang:\n  model-path: {tmp_path}\n  device: cpu\n  page-size: 64\n"
                "offload:\n  store:\n    path: /raid/sglang-offload\n")
    rc, _, err = run_cli(capsys, "detect", "--config", str(cfg))
    detect_warnings = [e[len("warning: "):] for e in err if e.startswith("warning: ")]
    assert rc == 0 and detect_warnings, err
    assert any("/raid/sglang-offload is on the system's / file system" in w
               or "holds the root file system" in w for w in detect_warnings), detect_warnings
    out = dry_run(capsys, cfg, root="/")
    assert out["warnings"] == detect_warnings
    rc, text, err = run_cli(capsys, "launch", "--config", str(cfg), "--dry-run")
    assert rc == 0 and [e for e in err if e.startswith("warning: ")] == \
        [f"warning: {w}" for w in detect_warnings]
    assert all(f"  - {w}" in text for w in detect_warnings)


def test_detect_with_a_python_that_does_not_exist_fails(capsys, tmp_path: Path) -> None:
    for exe in ("/nonexistent", str(tmp_path), "no-such-python-here"):
        rc, out, err = run_cli(capsys, "detect", "--python", exe)
        assert rc == 2 and out == "" and err == [
            f"error: --python {exe}: no such executable; name the interpreter that runs SGLang "
            "(e.g. /opt/venv/bin/python), or leave --python out for this one"]


def test_a_container_s_memory_limit_caps_the_host_s(capsys, tmp_path: Path) -> None:
    """Inside a pod /proc/meminfo is the node's; the cgroup's memory.max is what the pinned pools
    are charged to (and what SGLang sizes against)."""
    root = machine(tmp_path, 2048 * GIB, 2000 * GIB)
    cgroup = Path(root) / "sys" / "fs" / "cgroup"
    cgroup.mkdir(parents=True, exist_ok=True)
    (cgroup / "memory.max").write_text(f"{500 * GIB}\n")
    cfg = write(tmp_path, BOX_70B.format(size=100))
    rc, _, err = run_cli(capsys, "launch", "--config", str(cfg), "--dry-run", "--root", root)
    assert rc == 2 and "but this host has 536.9 GB (/sys/fs/cgroup/memory.max)" in err[0], err
    (cgroup / "memory.max").write_text("max\n")
    assert dry_run(capsys, cfg, root=root)["decision"]["path"]
