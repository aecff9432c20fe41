"""Parsing `plan`'s values: token counts (`128K`), parameter counts (`70.6B`), dtype names.

Each parser raises ConfigError naming the option (`what` / `flag`: `--context`,
`sglang.context-length`) with the value and what is allowed.
"""

from __future__ import annotations

import re

from offload.errors import ConfigError
from offload.plan.dtypes import canonical

KV_DTYPES = ("bf16", "fp16", "fp8")
WEIGHT_DTYPES = ("bf16", "fp16", "fp8", "int8", "int4")
MAX_TOKENS = 1 << 24            # 16M tokens: above any model's context window


def parse_tokens(text: str, what: str = "token count") -> int:
    """`131072`, `128K` / `128k` (x1024), `1M` (x2**20). `what` names the option in errors."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise ConfigError([f"{what} '{text}': expected a token count: an integer or e.g. 128K, "
                           "1M"])
    n = float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20}[m.group(2).lower()]
    if n < 1 or n != int(n):
        raise ConfigError([f"{what} '{text}': must be a whole number of at least 1"])
    if n > MAX_TOKENS:
        raise ConfigError([f"{what} '{text}': more than {MAX_TOKENS:,} (16M) tokens, longer "
                           "than any model's context window"])
    return int(n)


def parse_count(text: str, what: str) -> int:
    """`70553706496`, `70.6B`, `8e9`."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kKmMbBtT]?)\s*", str(text))
    if not m:
        raise ConfigError([f"{what} '{text}': expected a count such as 70.6B or 70553706496"])
    mult = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]
    n = int(float(m.group(1)) * mult)
    if n < 1:
        raise ConfigError([f"{what} '{text}': must be at least 1"])
    return n


def parse_dtype(text: str, allowed: tuple[str, ...], flag: str) -> str:
    """`text` in canonical spelling when it is one of `allowed`."""
    d = canonical(text)
    if d not in allowed:
        raise ConfigError([f"{flag} '{text}': one of {', '.join(allowed)}"])
    return d


