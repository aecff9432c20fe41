"""`sglang-offload demo-model --random` (random weights, for fast tests): the checkpoint loads as a
HuggingFace Llama with its tokenizer, the same options write the same bytes, every `--family`
writes a checkpoint transformers reads as that architecture, and bad options are one `error:` line
each (exit 2). The real model (no `--random`): tests/commands/test_demo_model_real.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offload import cli
from offload.demo import FAMILIES, DemoSpec, write_demo

SMALL = DemoSpec(layers=2, hidden=64, heads=2, kv_heads=1, intermediate=128, vocab=400)
SMALL_ARGS = ["--layers", "2", "--hidden", "64", "--heads", "2", "--kv-heads", "1",
              "--intermediate", "128", "--vocab", "400"]
# family -> (model_type, architecture) transformers must read from its config.json
FAMILY_TYPES = {"llama": ("llama", "LlamaForCausalLM"),
                "mla": ("deepseek_v2", "DeepseekV2ForCausalLM"),
                "swa": ("mellum", "MellumForCausalLM")}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    write_demo(out, SMALL)
    return out


def test_same_options_same_bytes(demo: Path, tmp_path: Path) -> None:
    write_demo(tmp_path, SMALL)
    for f in sorted(demo.iterdir()):
        assert (tmp_path / f.name).read_bytes() == f.read_bytes(), f.name
    write_demo(tmp_path / "other", DemoSpec(**{**SMALL.__dict__, "seed": 1}))
    assert (tmp_path / "other" / "model.safetensors").read_bytes() != (
        demo / "model.safetensors").read_bytes()


def test_loads_as_a_llama_with_its_tokenizer(demo: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(demo)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_key_value_heads) == ("llama", 2, 1)
    tok = AutoTokenizer.from_pretrained(demo)
    text = "the cache block, wörld 123!"
    assert tok.decode(tok(text)["input_ids"]) == text      # byte-level: any text round-trips
    assert len(tok) <= cfg.vocab_size and cfg.vocab_size % 64 == 0
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    with safe_open(str(demo / "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").shape == (cfg.vocab_size, 64)
        assert len(list(f.keys())) == 3 + 9 * 2
    assert "RANDOM WEIGHTS" in (demo / "README.md").read_text()


def test_every_family_is_tested() -> None:
    assert set(FAMILY_TYPES) == set(FAMILIES)


@pytest.mark.parametrize("family", ["mla", "swa"])         # llama: the tests above
def test_family_writes_a_checkpoint_of_its_architecture(family: str, demo: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    out = tmp_path / family
    assert cli.main(["demo-model", "--random", str(out), "--family", family, *SMALL_ARGS]) == 0
    assert f"({family}, random weights)" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in demo.iterdir())
    cfg = AutoConfig.from_pretrained(out)
    assert (cfg.model_type, cfg.architectures, cfg.num_hidden_layers) == (
        *FAMILY_TYPES[family][:1], [FAMILY_TYPES[family][1]], 2)
    assert AutoTokenizer.from_pretrained(out)("the cache")["input_ids"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").shape == (cfg.vocab_size, 64)
    assert "RANDOM WEIGHTS" in (out / "README.md").read_text()


@pytest.mark.parametrize("argv,expected", [
    (["--heads", "3"], "error: --hidden: 256 is not a multiple of --heads 3"),
    (["--kv-heads", "3"], "error: --kv-heads: 3 does not divide --heads 4"),
    (["--layers", "0", "--vocab", "10"], "error: --layers: 0 must be >= 1"),
])
def test_bad_options_are_error_lines(argv: list[str], expected: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo-model", "--random", str(tmp_path / "m"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == expected and "Traceback" not in err
    assert not (tmp_path / "m").exists()


def test_a_bad_family_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo-model", "--random", str(tmp_path / "m"), "--family", "gpt"]) == 2
    err = capsys.readouterr().err
    assert [ln for ln in err.splitlines() if "error:" in ln] == [
        "sglang-offload demo-model: error: argument --family: invalid choice: 'gpt' "
        "(choose from 'llama', 'mla', 'swa')"]
    assert not (tmp_path / "m").exists()


def test_refuses_a_non_empty_directory_without_force(demo: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "keep.txt").write_text("x")
    assert cli.main(["demo-model", "--random", str(tmp_path)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
    cfg = json.loads((demo / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]


def test_the_serving_skip_names_the_real_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without SGLang's serving dependencies the E2E tests skip, naming the set-up command."""
    import importlib.util

    from tests.e2e.conftest import serving_missing

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    message = serving_missing() or ""
    command = message.rsplit("`bash ", 1)[-1].rstrip("`")
    assert message.endswith("`") and command == "scripts/install.sh", message
    assert (Path(__file__).resolve().parents[2] / command).is_file()
