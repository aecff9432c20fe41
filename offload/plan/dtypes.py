"""The one table of element sizes: every dtype name the plan, launch and the backend meet.

`DTYPE_BYTES` maps canonical names (bf16, fp16, fp32, fp8, int8, int4) to bytes per element;
`canonical(name)` folds SGLang's and HuggingFace's spellings (bfloat16, half, fp8_e4m3, ...) onto
them; `dtype_bytes(name)` is the size of any spelling, None for a name it does not know.
"""

from __future__ import annotations

DTYPE_BYTES: dict[str, float] = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "fp8": 1.0, "int8": 1.0,
                                 "int4": 0.5}
ALIASES: dict[str, str] = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32",
                           "float32": "fp32", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "float8": "fp8",
                           "mxfp8": "fp8"}


def canonical(name: str) -> str:
    """`name` in canonical spelling (lower case; unknown names are returned as they are)."""
    low = name.lower()
    return ALIASES.get(low, low)


def dtype_bytes(name: str) -> float | None:
    """Bytes per element of a dtype in any known spelling, or None."""
    return DTYPE_BYTES.get(canonical(name))
