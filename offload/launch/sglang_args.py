"""The `sglang:` section of a deployment file, checked against SGLang's own argument parser.

Primitives:
- SGLang's parser comes from `offload.launch.argspec.sglang_parser()` (the installed SGLang's
  own, or the pinned release's snapshot where SGLang cannot import); only `launch` and
  `config validate` load it, once per process.
- `check_sglang(section, extra_argv, offload_cfg) -> SglangArgs`: every key checked (unknown keys
  name the close match, values go through the flag's own type and choices), the section turned
  into argv exactly as SGLang's own `--config` would, the extra CLI flags appended, the whole
  parsed, and combinations that cannot work with the offload tier refused. Raises `ConfigError`
  with one line per problem; `SglangArgs.warnings` holds what works but loses something.
- `page_slices(...)`: the byte size of one contiguous slice of a host-pool page (4 KiB alignment).

Rules (docs/deploy/launch.md): hierarchical cache on and the radix cache on; the storage backend and its
extra config's backend keys are ours (`hicache-storage-backend: offload` is accepted and ignored;
SGLang's own extra-config keys such as `prefetch_threshold` pass through); an unaligned page
slice or an unset / tiny `page-size` is a warning (the store falls back to one bounce-buffer copy),
a TP size the model's heads cannot split is an error.
"""

from __future__ import annotations

import argparse
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from offload import redact
from offload.config import OffloadConfig
from offload.errors import ConfigError
from offload.hicache.contract import SGLANG_KEYS
from offload.launch.argspec import ArgsRefused, sglang_parser, sglang_version
from offload.plan.dtypes import dtype_bytes
from offload.plan.presets import Architecture

ALIGN = 4096
MIN_PAGE_TOKENS = 16
# Flags launch composes itself: set by hand only as described in the error.
OURS = {"hicache_storage_backend", "hicache_storage_backend_extra_config"}
_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string",
               "human_readable_int": "an integer (e.g. 131072 or 128k)"}


@dataclass
class SglangArgs:
    """The `sglang:` section as SGLang argv, the parsed values, and what launch should know."""

    section_argv: list[str]              # the section, by SGLang's own --config conversion
    extra_argv: list[str]                # extra flags from the command line (appended last)
    values: argparse.Namespace           # SGLang's parse of section_argv + extra_argv
    extra_config: dict[str, Any]         # SGLang's own keys of the backend extra config
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    set_by_user: set[str] = field(default_factory=set)   # dests named in the file or the extras
    parser_source: str = ""              # SGLang's live parser, or the snapshot of it


def _norm(key: str) -> str:
    return key.replace("-", "_")


def _index(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every key SGLang's `--config` accepts (dest and each long spelling) -> its action."""
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.dest == "help":
            continue
        for key in {action.dest, *(_norm(o[2:]) for o in longs)}:
            out.setdefault(key, action)
    return out


def _flag(action: argparse.Action) -> str:
    return next(o for o in action.option_strings if o.startswith("--"))


def _type_word(action: argparse.Action) -> str:
    name = getattr(action.type, "__name__", "a string")
    return _TYPE_WORDS.get(name, f"a value {name} accepts")


def _check_value(key: str, value: Any, action: argparse.Action) -> str | None:
    """One problem line for `sglang.<key>: value`, or None if SGLang's flag takes it."""
    where = f"sglang.{key}"
    shown = redact.value(f"sglang.{action.dest}", value)     # a secret's value never quoted
    if isinstance(action, argparse._StoreTrueAction):
        return None if isinstance(value, bool) else (
            f"{where}: {shown} is not true or false (SGLang's {_flag(action)} is a switch)")
    if action.nargs == 0:
        return f"{where}: SGLang's {_flag(action)} cannot be set from a config file"
    if isinstance(value, (list, tuple)):
        if action.nargs in (None, "?"):
            return f"{where}: {shown} is a list; SGLang's {_flag(action)} takes one value"
        tokens = [str(v) for v in value]
    elif isinstance(value, Mapping):
        tokens = [json.dumps(value)]
    elif isinstance(value, bool):
        tokens = [str(value).lower()]
    elif value is None:
        return f"{where}: empty value; give {_type_word(action)} or remove the key"
    else:
        tokens = [str(value)]
    for token in tokens:
        converted: Any = token
        if callable(action.type):
            try:
                converted = action.type(token)
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                return (f"{where}: {shown} is not {_type_word(action)} (SGLang's "
                        f"{_flag(action)})")
        if action.choices is not None and converted not in action.choices:
            choices = [str(c) for c in action.choices]
            close = difflib.get_close_matches(str(converted), choices, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return (f"{where}: {shown} is not allowed{hint}; SGLang's {_flag(action)} takes "
                    f"one of {', '.join(sorted(choices))}")
    return None


def _to_argv(key: str, value: Any, action: argparse.Action) -> list[str]:
    """SGLang's own `--config` conversion (ConfigArgumentMerger) of one key."""
    if isinstance(action, argparse._StoreTrueAction):
        return [f"--{key}"] if value else []
    if isinstance(value, bool):
        return [f"--{key}", str(value).lower()]
    if isinstance(value, (list, tuple)):
        return [f"--{key}", *(str(v) for v in value)] if value else []
    if isinstance(value, Mapping):
        return [f"--{key}", json.dumps(value)]
    return [f"--{key}", str(value)]


def _extra_config(value: Any, problems: list[str]) -> dict[str, Any]:
    """The user's backend extra config: only SGLang's own keys may be given by hand."""
    where = "sglang.hicache-storage-backend-extra-config"
    if isinstance(value, str):
        if value.startswith("@"):
            problems.append(f"{where}: a file reference ({value}) cannot be merged with the "
                            "offload settings; give the keys inline (a mapping)")
            return {}
        try:
            value = json.loads(value)
        except ValueError as e:
            problems.append(f"{where}: not a JSON object ({e})")
            return {}
    if not isinstance(value, Mapping):
        problems.append(f"{where}: expected a mapping, got {value!r}")
        return {}
    out = {}
    for k, v in value.items():
        if k in SGLANG_KEYS:
            out[k] = v
        else:
            problems.append(f"{where}.{k}: set by launch (the offload backend's settings come "
                            "from the offload: section); allowed here: "
                            + ", ".join(SGLANG_KEYS))
    return out


def check_sglang(section: Mapping[str, Any], extra_argv: list[str] | None = None,
                 offload_cfg: OffloadConfig | None = None) -> SglangArgs:
    """Validate the `sglang:` section (+ extra CLI flags). Raises ConfigError, one line each."""
    parser, source = sglang_parser()
    index = _index(parser)
    problems: list[str] = []
    argv: list[str] = []
    user: set[str] = set()
    extra_cfg: dict[str, Any] = {}
    for key, value in section.items():
        key = str(key)
        action = index.get(_norm(key))
        if action is None:
            close = difflib.get_close_matches(_norm(key), list(index), n=1)
            hint = f" (did you mean {close[0].replace('_', '-')!r}?)" if close else ""
            problems.append(f"sglang.{key}: not a server argument of SGLang "
                            f"{sglang_version()}{hint}")
            continue
        user.add(action.dest)
        if action.dest == "enable_hierarchical_cache" and value is False:
            problems.append(f"sglang.{key}: false, but the offload tier is HiCache's storage "
                            "layer: launch turns the hierarchical cache on; remove the key")
            continue
        if action.dest == "hicache_storage_backend":
            if value != "offload":
                problems.append(f"sglang.{key}: {value!r} conflicts with the offload tier: "
                                "launch sets the storage backend itself (the dynamic backend "
                                "offload.hicache.OffloadStorage); remove the key")
            continue                     # 'offload' (the patched name) is what launch sets
        if action.dest == "hicache_storage_backend_extra_config":
            extra_cfg = _extra_config(value, problems)
            continue
        line = _check_value(key, value, action)
        if line:
            problems.append(line)
            continue
        argv += _to_argv(key, value, action)
    extra_argv = list(extra_argv or [])
    for token in extra_argv:
        if token.startswith("--"):
            action = index.get(_norm(token[2:].split("=", 1)[0]))
            if action is not None:
                user.add(action.dest)
                if action.dest in OURS:
                    problems.append(f"{token}: launch sets the storage backend itself; put its "
                                    "settings in the offload: section")
    if problems:
        raise ConfigError(problems)
    try:
        values = parser.parse_args(argv + extra_argv)
    except ArgsRefused as e:
        where = "extra SGLang flags" if extra_argv else "sglang"
        raise ConfigError([f"{where}: SGLang refuses the arguments: {e}"]) from None
    out = SglangArgs(section_argv=argv, extra_argv=extra_argv, values=values,
                     extra_config=extra_cfg,
                     set_by_user=user, parser_source=source)
    _combinations(out, offload_cfg or OffloadConfig())
    return out


def _combinations(args: SglangArgs, cfg: OffloadConfig) -> None:
    """Refuse what cannot work with the tier; warn about what works but loses something."""
    v = args.values
    problems: list[str] = []
    if v.disable_radix_cache:
        problems.append("sglang.disable-radix-cache: true, but the hierarchical cache (and so the "
                        "offload tier) keeps prefixes in the radix cache; remove the key")
    if getattr(v, "enable_unified_cache_external_linker", False):
        problems.append("sglang.enable-unified-cache-external-linker: SGLang cannot combine it "
                        "with the hierarchical cache the offload tier needs; remove the key")
    if getattr(v, "enable_lmcache", False):
        problems.append("sglang.enable-lmcache: LMCache replaces HiCache's storage layer; it "
                        "cannot run with the offload tier; remove the key")
    if v.page_size is not None and v.page_size < 1:
        problems.append(f"sglang.page-size: {v.page_size} must be >= 1")
    arch, source = _architecture(v.model_path)
    if arch is not None and not problems:
        from offload.plan.model import kv_heads_per_rank

        try:
            kv_heads_per_rank(arch, v.tp_size)
        except ConfigError as e:
            problems.append(f"sglang.tp-size: {v.tp_size} cannot split {arch.name}: "
                            + e.problems[0].removeprefix(f"--tp {v.tp_size} "))
    if problems:
        raise ConfigError(problems)
    if v.page_size is None:
        args.warnings.append("sglang.page-size: unset, so SGLang picks it (1 token on most "
                             "attention backends) and every stored block is a single token; "
                             "set page-size (64 is a good start)")
    elif v.page_size < MIN_PAGE_TOKENS:
        args.warnings.append(f"sglang.page-size: {v.page_size} tokens per stored block: the "
                             "per-block cost (index row, key, one I/O) dominates; use 64")
    if arch is None:
        args.notes.append(f"page alignment not checked: {source}")
        return
    kv = _kv_bytes(v.kv_cache_dtype, v.dtype)
    if kv is None:
        args.notes.append(f"page alignment not checked: kv-cache-dtype {v.kv_cache_dtype} packs "
                          "scales with the values")
        return
    page = v.page_size or 1
    slice_bytes = page_slices(arch, v.tp_size, page, v.hicache_mem_layout, kv)
    if slice_bytes % ALIGN:
        good = next((p for p in (16, 32, 64, 128, 256) if p >= page and
                     page_slices(arch, v.tp_size, p, v.hicache_mem_layout, kv) % ALIGN == 0), None)
        fix = f"; page-size {good} aligns" if good else ""
        args.warnings.append(
            f"sglang.page-size: {page} gives {slice_bytes}-byte slices in the "
            f"{v.hicache_mem_layout} host pool ({arch.name}, tp {v.tp_size}), not a multiple of "
            f"4 KiB: O_DIRECT I/O goes through a bounce buffer (one copy) instead of zero "
            f"copy{fix}")
    else:
        args.notes.append(f"page slices: {slice_bytes} bytes ({v.hicache_mem_layout}, "
                          f"{arch.name}, tp {v.tp_size}, page {page}) - 4 KiB-aligned, zero copy")


def _kv_bytes(kv_cache_dtype: str, dtype: str) -> float | None:
    if kv_cache_dtype in (None, "auto"):          # the model's dtype; its "auto" is bf16
        return dtype_bytes(dtype if dtype and dtype != "auto" else "bf16")
    return dtype_bytes(kv_cache_dtype)


def page_slices(arch: Architecture, tp: int, page_size: int, layout: str, kv_bytes: float) -> int:
    """Bytes of one contiguous slice of a page in SGLang's host pool (the unit of one I/O)."""
    from offload.plan.model import kv_heads_per_rank

    per_token_layer = ((arch.kv_lora_rank + arch.qk_rope_head_dim) if arch.mla
                       else kv_heads_per_rank(arch, tp) * arch.head_dim) * kv_bytes
    layers = 1 if layout == "layer_first" else arch.layers
    return int(page_size * layers * per_token_layer)


def _architecture(model_path: str | None) -> tuple[Architecture | None, str]:
    """The model's shape from a local config.json or a plan preset, else (None, why not)."""
    from offload.plan.presets import architecture_from_config, find_model, load_architecture

    if not model_path:
        return None, "no model-path"
    path = Path(model_path)
    if (path / "config.json").is_file():
        try:
            return load_architecture(str(path))[0], str(path / "config.json")
        except ConfigError as e:
            return None, e.problems[0]
    name = path.name
    for suffix in ("", "-Instruct", "-Chat", "-Base"):
        if suffix and not name.endswith(suffix):
            continue
        preset = find_model(name.removesuffix(suffix) if suffix else name)
        if preset is not None:
            return architecture_from_config(preset.config, preset.name, preset.params,
                                            preset.name), f"preset {preset.name}"
    return None, (f"{model_path} is neither a local directory with config.json nor a model "
                  "preset of `sglang-offload plan`")
