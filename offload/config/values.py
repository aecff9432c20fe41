"""The value grammar of the config tree: sizes, the on/off/auto switch, and how each type is named
to the user.

Primitives:
- `Size`: a byte count (an `int`) parsed from a plain integer or a number with a unit (`512MiB`,
  `2TiB`, `1.5GB`); `str(size)` prints it back (`2TiB`).
- `format_size(n)`: bytes for people (`64MiB`, `1.50GiB`).
- `OnOffAuto`: the three-way setting of an accelerated path (`on` fails loudly, `auto` falls back).
- `type_name(tp)`: what a value of a key's type looks like (`one of 'on', 'off', 'auto'`), used in
  error lines and in the generated reference.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Literal

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4, "p": 1000**5, "pb": 1000**5,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "pib": 1 << 50,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class Size(int):
    """A byte count parsed from `512MiB`, `2TiB`, `1.5GB` or a plain integer."""

    @classmethod
    def parse(cls, value: object) -> "Size":
        if isinstance(value, bool):
            raise ValueError("a size, not a boolean")
        if isinstance(value, int):
            if value < 0:
                raise ValueError("a size cannot be negative")
            return cls(value)
        if isinstance(value, str):
            m = _SIZE_RE.match(value)
            if m and m.group(2).lower() in _UNITS:
                return cls(int(float(m.group(1)) * _UNITS[m.group(2).lower()]))
        raise ValueError("a size: bytes or a number with a unit, e.g. 512MiB, 2TiB, 1.5GB")

    def __str__(self) -> str:
        return format_size(int(self))


def format_size(n: int) -> str:
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult:
            return f"{n / mult:.2f}{unit}"
    return f"{n}B"


OnOffAuto = Literal["on", "off", "auto"]


def type_name(tp: Any) -> str:
    """What a value of type `tp` looks like, for an error line or the reference's type column."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(type_name(a) for a in args) + " or null"
    if tp is Size:
        return "a size (e.g. 512MiB, 2TiB)"
    if origin is tuple:
        return "a list of " + {str: "strings"}.get(typing.get_args(tp)[0], "values")
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp)))
