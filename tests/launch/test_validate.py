"""The sglang: section against SGLang's own parser: one clear line per wrong key, type or
combination, for both `launch` and `config validate`; extra flags; the parser snapshot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from offload.config import load_file
from offload.errors import ConfigError
from offload.hicache.contract import SGLANG_KEYS as SGLANG_EXTRA_KEYS
from offload.launch import argspec as launch_argspec
from offload.launch.sglang_args import check_sglang
from tests.launch.helpers import CONFIGS, GPU_HOST, REPO, dry_run, fake_python, run_cli, write

BASE = "sglang:\n  model-path: meta-llama/Llama-3.1-70B-Instruct\n  tp-size: 8\n  page-size: 64\n"


def one_error(capsys: pytest.CaptureFixture[str], path: Path, *extra: str) -> str:
    """Both commands refuse the file with exit 2 and exactly one `error:` line; return it."""
    rc, _, err = run_cli(capsys, "launch", "--config", str(path), "--dry-run", *extra)
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    if not extra:
        rc2, _, err2 = run_cli(capsys, "config", "validate", str(path))
        assert (rc2, err2) == (2, err)
    return err[0]


def test_unknown_key_names_it_and_the_close_match(capsys, tmp_path) -> None:
    line = one_error(capsys, write(tmp_path, BASE + "  context-lenght: 131072\n"))
    assert line == ("error: sglang.context-lenght: not a server argument of SGLang "
                    f"{launch_argspec.sglang_version()} (did you mean 'context-length'?)")


def test_wrong_type(capsys, tmp_path) -> None:
    line = one_error(capsys, write(tmp_path, BASE.replace("tp-size: 8", "tp-size: eight")))
    assert line == "error: sglang.tp-size: 'eight' is not an integer (SGLang's --tp-size)"


def test_wrong_choice_suggests(capsys, tmp_path) -> None:
    line = one_error(capsys, write(tmp_path, BASE + "  kv-cache-dtype: fp8_e4m4\n"))
    assert line.startswith("error: sglang.kv-cache-dtype: 'fp8_e4m4' is not allowed (did you "
                           "mean 'fp8_e4m3'?)")


def test_switch_needs_a_boolean(capsys, tmp_path) -> None:
    line = one_error(capsys, write(tmp_path, BASE + "  enable-metrics: yes please\n"))
    assert "is not true or false" in line


@pytest.mark.parametrize("text,needle", [
    ("  disable-radix-cache: true\n", "sglang.disable-radix-cache: true, but the hierarchical"),
    ("  enable-hierarchical-cache: false\n", "sglang.enable-hierarchical-cache: false"),
    ("  hicache-storage-backend: file\n", "'file' conflicts with the offload tier"),
    ("  hicache-storage-backend-extra-config: {backend_name: mine}\n",
     "hicache-storage-backend-extra-config.backend_name: set by launch"),
    ("  enable-lmcache: true\n", "LMCache replaces HiCache"),
])
def test_impossible_combination(capsys, tmp_path, text: str, needle: str) -> None:
    assert needle in one_error(capsys, write(tmp_path, BASE + text))


def test_tp_size_the_model_cannot_split(capsys, tmp_path) -> None:
    line = one_error(capsys, write(tmp_path, BASE.replace("tp-size: 8", "tp-size: 3")))
    assert line.startswith("error: sglang.tp-size: 3 cannot split Llama-3.1-70B")


def test_extra_flags_are_checked_and_win(capsys, tmp_path) -> None:
    cfg = write(tmp_path, BASE)
    out = dry_run(capsys, cfg, "--", "--port", "30001", "--hicache-mem-layout", "layer_first")
    assert out["argv"][-4:] == ["--port", "30001", "--hicache-mem-layout", "layer_first"]
    assert out["argv"].count("--hicache-mem-layout") == 1       # launch's default not added
    assert "refuses the arguments" in one_error(capsys, cfg, "--", "--tp-size", "x")
    assert "keeps prefixes in the radix" in one_error(capsys, cfg, "--", "--disable-radix-cache")
    assert "sets the storage backend" in one_error(capsys, cfg, "--",
                                                   "--hicache-storage-backend", "file")


def test_offload_backend_name_and_sglang_extra_keys_pass(capsys, tmp_path) -> None:
    cfg = write(tmp_path, BASE + "  hicache-storage-backend: offload\n"
                "  hicache-storage-backend-extra-config: {prefetch_threshold: 512}\n")
    argv = dry_run(capsys, cfg)["argv"]
    assert argv[argv.index("--hicache-storage-backend") + 1] == "dynamic"
    extra = json.loads(argv[argv.index("--hicache-storage-backend-extra-config") + 1])
    assert extra["prefetch_threshold"] == 512 and extra["class_name"] == "OffloadStorage"


def test_unaligned_page_slices_warn_with_the_fix(capsys, tmp_path) -> None:
    cfg = write(tmp_path, BASE.replace("page-size: 64", "page-size: 4")
                + "  hicache-mem-layout: layer_first\n")
    rc, out, err = run_cli(capsys, "launch", "--config", str(cfg), "--dry-run", "--root", GPU_HOST)
    assert rc == 0
    assert any("1024-byte slices in the layer_first host pool" in e and "page-size 16 aligns"
               in e for e in err), err
    assert any(e.startswith("warning: sglang.page-size: 4 tokens per stored block") for e in err)
    assert "Warnings" in out


def test_unset_page_size_warns(capsys, tmp_path) -> None:
    rc, _, err = run_cli(capsys, "config", "validate",
                         str(write(tmp_path, BASE.replace("  page-size: 64\n", ""))))
    assert rc == 0 and any("sglang.page-size: unset" in e for e in err)


def test_config_validate_covers_both_sections(capsys, tmp_path) -> None:
    cfg = write(tmp_path, BASE + "  tp-sise: 8\noffload:\n  store: {capacity: lots}\n")
    rc, _, err = run_cli(capsys, "config", "validate", str(cfg))
    assert rc == 2 and len(err) == 1 and "offload.store.capacity" in err[0]   # ours first
    cfg = write(tmp_path, BASE + "  tp-sise: 8\n")
    rc, _, err = run_cli(capsys, "config", "validate", str(cfg))
    assert rc == 2 and "sglang.tp-sise" in err[0]
    rc, _, _ = run_cli(capsys, "config", "validate", "--offload-only", str(cfg))
    assert rc == 0
    rc, out, _ = run_cli(capsys, "config", "validate", str(CONFIGS / "cpu-dev.yaml"))
    model = yaml.safe_load((CONFIGS / "cpu-dev.yaml").read_text())["sglang"]["model-path"]
    assert rc == 0 and f"model-path: {model}" in out


def test_extra_keys_agree_with_the_backend() -> None:
    backend = pytest.importorskip("offload.hicache.backend")
    assert SGLANG_EXTRA_KEYS == backend.SGLANG_KEYS


def test_snapshot_is_the_pinned_parser() -> None:
    live = launch_argspec.live_parser()
    want = launch_argspec.dumps(launch_argspec.snapshot(live, "0.5.23"))
    assert launch_argspec.SNAPSHOT.read_text() == want, (
        "regenerate: python -m offload.launch.argspec > offload/launch/sglang_args.json")


def test_snapshot_parser_decides_like_the_live_one(tmp_path) -> None:
    snap = launch_argspec.parser_from_snapshot(json.loads(launch_argspec.SNAPSHOT.read_text()))
    live = launch_argspec.live_parser()
    for path in sorted(CONFIGS.glob("*.yaml")):
        argv = check_sglang(load_file(path).sglang).section_argv
        assert vars(snap.parse_args(argv)) == vars(live.parse_args(argv)), path.name
    for bad in (["--model-path", "m", "--tp-size", "x"], ["--model-path", "m", "--dtype", "f8"],
                ["--tp-size", "1"]):
        for parser in (snap, live):
            with pytest.raises(launch_argspec.ArgsRefused):
                parser.parse_args(bad)


def test_snapshot_stands_in_when_sglang_cannot_import(monkeypatch) -> None:
    def no_sglang() -> None:
        raise ModuleNotFoundError("No module named 'torch'")

    launch_argspec.sglang_parser.cache_clear()
    monkeypatch.setattr(launch_argspec, "live_parser", no_sglang)
    try:
        sg = check_sglang(load_file(CONFIGS / "llama-3.1-8b-128k-h200.yaml").sglang)
        assert sg.parser_source.startswith("snapshot of SGLang 0.5.23's parser")
        with pytest.raises(ConfigError, match="did you mean 'tp-size'"):
            check_sglang({"model-path": "m", "tp-sise": 1})
    finally:
        launch_argspec.sglang_parser.cache_clear()


def test_launch_execs_sglang_in_place(tmp_path) -> None:
    """Without --dry-run the process becomes the SGLang command (same PID, same argv)."""
    fake = fake_python(tmp_path / "python", 'echo "pid=$$"\nfor a in "$@"; do echo "arg=$a"; done\n')
    cfg = write(tmp_path, BASE + "offload:\n  store: {path: " + str(tmp_path / "c") + "}\n")
    code = ("import os, sys; from offload import cli; print(f'pid={os.getpid()}', flush=True); "
            "sys.exit(cli.main(sys.argv[1:]))")
    res = subprocess.run([sys.executable, "-c", code, "launch", "--config", str(cfg),
                          "--python", str(fake), "--root", GPU_HOST, "--", "--port", "30001"],
                         capture_output=True, text=True, cwd=REPO, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == lines[1]                          # exec: SGLang runs in the same process
    args = [ln[4:] for ln in lines[2:]]
    assert args[:4] == ["-m", "sglang.launch_server", "--model-path",
                        "meta-llama/Llama-3.1-70B-Instruct"]
    assert args[-2:] == ["--port", "30001"]


def test_hierarchical_cache_set_in_the_file_appears_once(capsys, tmp_path) -> None:
    argv = dry_run(capsys, write(tmp_path, BASE + "  enable-hicache: true\n"))["argv"]
    assert argv.count("--enable-hicache") + argv.count("--enable-hierarchical-cache") == 1


def test_json_without_dry_run_is_refused(capsys, tmp_path) -> None:
    rc, _, err = run_cli(capsys, "launch", "--config", str(write(tmp_path, BASE)), "--json")
    assert rc == 2 and err == ["error: --json goes with --dry-run (without it, launch starts "
                               "SGLang)"]
