"""Write the demo checkpoint: `write_demo(directory, spec) -> list of files written`.

Files: config.json (LlamaForCausalLM), generation_config.json (greedy), model.safetensors (random
normal(0, 0.02) weights, norms at 1, from `spec.seed`), tokenizer.json, tokenizer_config.json and a
README.md that says the weights are random. Refuses a non-empty directory unless `overwrite`.
Same spec, same bytes: one CPU generator, sorted tensor names, fixed JSON formatting.

How every demo model reaches DIR (this one and the real one, `offload.demo.real`):
`check_target(DIR, overwrite) -> Target` before anything is written, then
`write_staged(target, write, key, need)`: the files written into a staging directory, then moved
into DIR, `key` last; on any error DIR is as it was (each replaced file put back).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offload.demo.spec import DemoSpec
from offload.demo.tokenizer import BOS, EOS, build_tokenizer, tokenizer_config
from offload.errors import ConfigError

log = logging.getLogger(__name__)
ASIDE = ".replaced"               # in the staging directory: DIR's files the new ones replace

NOTICE = ("RANDOM WEIGHTS: a demo model written by `sglang-offload demo-model`. The text it "
          "generates is gibberish; the KV path (prefill, radix cache, HiCache, the offload tier) "
          "is the real one. Point sglang.model-path at real weights for real text.")


def _config(spec: DemoSpec, vocab: int, bos: int, eos: int) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": spec.hidden, "intermediate_size": spec.intermediate,
            "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim,
            "hidden_act": "silu", "max_position_embeddings": spec.context,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": None,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "vocab_size": vocab, "bos_token_id": bos, "eos_token_id": eos,
            "torch_dtype": spec.dtype, "_name_or_path": "sglang-offload-demo", "_comment": NOTICE}


def _weights(spec: DemoSpec, vocab: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    h, d, kv = spec.hidden, spec.head_dim, spec.kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h),
                                          "lm_head.weight": (vocab, h)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (spec.heads * d, h),
                   p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                   p + "self_attn.o_proj.weight": (h, spec.heads * d),
                   p + "mlp.gate_proj.weight": (spec.intermediate, h),
                   p + "mlp.up_proj.weight": (spec.intermediate, h),
                   p + "mlp.down_proj.weight": (h, spec.intermediate),
                   p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    shapes["model.norm.weight"] = (h,)
    out = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shapes[name], dtype=dtype)
        else:
            out[name] = (torch.randn(shapes[name], generator=g) * 0.02).to(dtype)
    return out


def _dump(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_demo(directory: str | Path, spec: DemoSpec, overwrite: bool = False,
               adjust: Callable[[Path], None] | None = None) -> list[Path]:
    """Write the checkpoint into `directory` (created; with `overwrite` only its files are
    replaced). Raises ConfigError before writing. `adjust(stage)` changes the staged files (the
    other families' config and weights) before they are moved into place."""
    spec.check()
    target = check_target(directory, overwrite)
    from safetensors.torch import save_file

    tok = build_tokenizer(spec.vocab)
    bos, eos = tok.token_to_id(BOS) or 0, tok.token_to_id(EOS) or 1   # the first two tokens
    vocab = -(-tok.get_vocab_size() // 64) * 64

    def write(stage: Path) -> list[str]:
        names = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "README.md"]
        _dump(stage / names[0], _config(spec, vocab, bos, eos))
        _dump(stage / names[1], {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False,
                                 "pad_token_id": eos})
        save_file(_weights(spec, vocab), str(stage / names[2]),
                  metadata={"format": "pt"})    # one key: safetensors writes it in hash order
        tok.save(str(stage / names[3]))
        _dump(stage / names[4], tokenizer_config(spec.context))
        (stage / names[5]).write_text(f"# sglang-offload demo model\n\n{NOTICE}\n\nShape: {spec}\n")
        if adjust:
            adjust(stage)
        return names

    return write_staged(target, write, key="config.json", need="space for the model")


@dataclass(frozen=True)
class Target:
    """DIR as first checked: its absolute path (links in its parents kept), whether its model
    files may be replaced, and its lstat where it exists (compared again before publishing)."""

    out: Path
    overwrite: bool
    seen: os.stat_result | None


def check_target(directory: str | Path, overwrite: bool) -> Target:
    """DIR new, or an empty directory (any directory with `overwrite`), not a symbolic link."""
    if str(directory) == "":                   # "$DIR" unset: abspath("") is the working directory
        raise ConfigError(["DIR: empty (an unset variable?); name a new or empty directory"])
    out = Path(os.path.abspath(directory))     # "." or "m/": a name and a parent (links kept)
    try:
        seen = os.lstat(out)
        if stat.S_ISDIR(seen.st_mode):
            with os.scandir(out) as entries:
                full = any(entries)
    except FileNotFoundError:
        return Target(out, overwrite, None)
    except OSError as e:                       # a name too long, a parent that is a file, ...
        raise ConfigError([f"DIR: cannot write {out}: {e.strerror or e}; name a writable "
                           "directory"]) from e
    if stat.S_ISLNK(seen.st_mode):
        raise ConfigError([f"DIR: {out} is a symbolic link; name the directory itself"])
    if not stat.S_ISDIR(seen.st_mode):
        raise ConfigError([f"DIR: {out} is not a directory; name a new or empty directory"])
    if full and not overwrite:
        raise ConfigError([f"DIR: {out} is not empty; name a new or empty directory, or pass "
                           "--force to replace the model's files in it (other files are kept)"])
    return Target(out, overwrite, seen)


def write_staged(target: Target, write: Callable[[Path], list[str]], key: str,
                 need: str) -> list[Path]:
    """`write(stage)` fills a staging directory and names its files; they are then moved into
    DIR (`_publish`). On any error DIR is as it was and the staging directory is gone; an OSError
    is a ConfigError naming its cause (`need`: the space to free where the disk is full)."""
    stage, made = _stage(target)
    try:
        names = write(stage)
        _publish(target, stage, names, key)
    except BaseException as e:
        _clean(stage, made)
        if isinstance(e, OSError):
            raise ConfigError([f"DIR: cannot write {target.out}: {e.strerror or e}; "
                               f"{_FIX.get(e.errno or 0, 'name a writable directory')}"
                               .format(need=need)]) from e
        raise
    return [target.out / n for n in names]


_FIX = {errno.ENOSPC: "free {need} there", errno.EDQUOT: "free {need} there",
        errno.EXDEV: "DIR or a file in it is on another file system than its staging directory: "
                     "name a directory on one file system"}


def _stage(target: Target) -> tuple[Path, list[Path]]:
    """A new staging directory where a rename into DIR stays on one file system: beside DIR
    (the parents made for a new DIR listed), inside an existing DIR where it is a mount point or
    only DIR is writable."""
    out, seen = target.out, target.seen
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if seen is None or os.stat(out.parent).st_dev == seen.st_dev:
            try:
                return Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial",
                                             dir=out.parent)), made
            except PermissionError:
                if seen is None:
                    raise
        return Path(tempfile.mkdtemp(prefix=".demo-model.", suffix=".partial", dir=out)), made
    except OSError as e:
        _clean(None, made)
        raise ConfigError([f"DIR: cannot write {out}: {e.strerror or e}; name a writable "
                           "directory"]) from e


def _clean(stage: Path | None, made: list[Path]) -> None:
    """Remove the staging directory (kept where it holds replaced files not put back) and the
    parents made for DIR (deepest first: each was empty when made)."""
    if stage is not None and os.path.lexists(stage):
        kept = stage / ASIDE
        if kept.is_dir() and any(kept.iterdir()):
            log.error("the files replaced in DIR could not be put back: they are in %s", kept)
            return
        shutil.rmtree(stage, ignore_errors=True)
    for p in made:
        with contextlib.suppress(OSError):
            p.rmdir()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(target: Target, stage: Path, names: list[str], key: str) -> None:
    """Move the staged files into DIR, once DIR is checked again (the same directory as first
    seen: not a link put there meanwhile). A new DIR is the staging directory renamed: the whole
    checkpoint or nothing. An existing DIR (its inode, owner and mode kept: a mount point, a
    shell's working directory) gets the files one by one, `key` moved away first and put last."""
    out, seen = target.out, target.seen
    mask = os.umask(0)
    os.umask(mask)
    for n in names:
        (stage / n).chmod(0o666 & ~mask)
        _fsync(stage / n)
    try:
        now: os.stat_result | None = os.lstat(out)
    except FileNotFoundError:
        now = None
    if now is not None and (not stat.S_ISDIR(now.st_mode) or seen is not None and (
            now.st_dev, now.st_ino) != (seen.st_dev, seen.st_ino)):
        what = "a symbolic link" if stat.S_ISLNK(now.st_mode) else "another directory" if (
            stat.S_ISDIR(now.st_mode)) else "not a directory"
        raise ConfigError([f"DIR: {out} was replaced while writing (now {what}); nothing "
                           "written: run again"])
    filled = ConfigError([f"DIR: {out} is not empty (filled while converting); name a new or "
                          "empty directory, or pass --force"])
    if seen is None:
        stage.chmod(0o777 & ~mask)
        _fsync(stage)
        try:
            os.rename(stage, out)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise filled from e
        _fsync(out.parent)
        return
    if not target.overwrite and any(p != stage for p in out.iterdir()):
        raise filled
    blocked = [n for n in names if (out / n).is_dir() and not (out / n).is_symlink()]
    if blocked:
        raise ConfigError([f"DIR: {out / blocked[0]} is a directory; the model writes a file "
                           "there: move it away"])
    _replace(stage, out, [*(n for n in names if n != key), key])
    _fsync(out)


def _replace(stage: Path, out: Path, order: list[str]) -> None:
    """Move `order`'s files from `stage` into `out`, the last one moved away first; each file
    replaced is moved aside (stage/ASIDE) and, on any error, every one put back: `out` as it was."""
    aside = stage / ASIDE
    aside.mkdir()
    moved: list[str] = []
    placed: list[str] = []

    def away(n: str) -> None:
        if os.path.lexists(out / n) and n not in moved:
            os.replace(out / n, aside / n)
            moved.append(n)

    try:
        away(order[-1])
        for n in order:
            away(n)
            os.replace(stage / n, out / n)
            placed.append(n)
    except BaseException:
        for n in reversed(placed):             # each step alone: what cannot be put back stays
            if n not in moved:                 # in ASIDE, kept (`_clean`)
                with contextlib.suppress(OSError):
                    (out / n).unlink()
        for n in reversed(moved):
            with contextlib.suppress(OSError):
                os.replace(aside / n, out / n)
        raise
    shutil.rmtree(aside)
    stage.rmdir()
