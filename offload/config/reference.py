"""The configuration reference, generated from the tree: one row per setting, the table of
docs/reference/config.md (tests/test_readme.py checks the page is the generated one).

Primitives:
- `reference()` -> `[(key path, type, default, doc)]`, in the order the tree declares them.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from offload.config.tree import OffloadConfig, to_dict
from offload.config.values import type_name


def reference() -> list[tuple[str, str, str, str]]:
    """(key path, type, default, doc) for every setting: the README's config reference."""
    rows: list[tuple[str, str, str, str]] = []

    def walk(cls: Any, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}.{f.name}")
                continue
            default = to_dict(f.default) if f.default is not dataclasses.MISSING else ""
            rows.append((f"{prefix}.{f.name}", type_name(tp), repr(default),
                         f.metadata.get("doc", "")))

    walk(OffloadConfig, "offload")
    return rows
