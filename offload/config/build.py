"""Strict building: plain data (parsed YAML) -> a frozen dataclass of the tree, collecting every
problem with its key path instead of stopping at the first.

Primitives:
- `build(cls, data, path, problems)`: an instance of the dataclass `cls` from the mapping `data`;
  an unknown key (with the closest allowed one), a removed key (with what to do instead) or a value
  of the wrong type is one line appended to `problems`, and that key keeps its default.
- `convert(tp, value, path, problems)`: one value to the key's type (`Size`, a literal, a list...).
- `REMOVED_KEYS`: keys accepted once and refused now, each with what to do instead.

Ranges and combinations of keys are checked afterwards, on the built tree (`checks.py`).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Mapping

from offload import redact
from offload.config.values import Size, type_name


def convert(tp: Any, value: Any, path: str, problems: list[str]) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return convert(inner[0], value, path, problems)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed and type(value) is type(allowed[0]):
            return value
        problems.append(f"{path}: {redact.value(path, value)} is not allowed; use {type_name(tp)}")
        return None
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, problems)
    if origin is tuple:   # tuple[X, ...]: a YAML list
        if not isinstance(value, (list, tuple)):
            problems.append(f"{path}: {redact.value(path, value)} is not a list")
            return None
        item = typing.get_args(tp)[0]
        out = [convert(item, v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
        return tuple(out) if all(v is not None for v in out) else None
    if tp is Size:
        try:
            return Size.parse(value)
        except ValueError as e:
            problems.append(f"{path}: {redact.value(path, value)} is not {e}")
            return None
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - schema error, not user error
        raise TypeError(f"unsupported config type {tp!r} at {path}")
    problems.append(f"{path}: {redact.value(path, value)} is not {type_name(tp)}")
    return None


# Keys that were accepted once and are refused now, with what to do instead.
REMOVED_KEYS = {
    "offload.redis.directory": "removed: it was accepted but no data path used it; delete the key "
                               "(pod-wide sharing of blocks through several agents is planned as "
                               "its own capability)",
}


def build(cls: Any, data: Any, path: str, problems: list[str]) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        problems.append(f"{path}: expected a mapping of keys, got {type(data).__name__} "
                        f"{redact.text(repr(data))}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if f"{path}.{key}" in REMOVED_KEYS:
            problems.append(f"{path}.{key}: {REMOVED_KEYS[f'{path}.{key}']}")
            continue
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"{path}.{key}: unknown key{hint}; allowed: {', '.join(names)}")
            continue
        converted = convert(hints[key], value, f"{path}.{key}", problems)
        if converted is not None or value is None:
            kwargs[key] = converted
    return cls(**kwargs)
