"""What a deployment file says that `plan` sizes: `from_config(cfg) -> Deployment`.

Read from the `sglang:` section (SGLang's own flag names, `-` or `_`): model-path, tp-size,
dp-size, context-length, kv-cache-dtype, dtype / quantization (the weights), mem-fraction-static,
page-size, hicache-size (GB per GPU), hicache-ratio; from `offload:` the L3's capacity
(store.capacity; none for the DPU path, whose agent has its own `--capacity`) and kind. A field is
None when the file does not set it; a value `plan` cannot use is a ConfigError naming its key.
The drives' bandwidth is read by `offload.commands.plan` (it needs detection).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from offload.config import DeploymentConfig
from offload.errors import ConfigError
from offload.plan.dtypes import canonical
from offload.plan.parse import KV_DTYPES, WEIGHT_DTYPES, parse_dtype

# SGLang --quantization methods and the bytes they leave per weight (the rest: ask for --params /
# --weight-dtype).
_QUANT = {"fp8": "fp8", "w8a8_fp8": "fp8", "modelopt_fp8": "fp8", "fbgemm_fp8": "fp8",
          "w8a8_int8": "int8", "awq": "int4", "gptq": "int4", "awq_marlin": "int4",
          "gptq_marlin": "int4"}


@dataclass(frozen=True)
class Deployment:
    model: str | None = None
    tp: int | None = None
    dp: int | None = None
    context: int | None = None
    kv_dtype: str | None = None
    weight_dtype: str | None = None
    mem_fraction: float | None = None
    page_size: int | None = None
    l2_size: int | None = None           # bytes per GPU
    l2_ratio: float | None = None
    tier_capacity: int | None = None
    tier_name: str = "L3"


def _get(sglang: Mapping[str, Any], key: str) -> Any:
    return sglang.get(key, sglang.get(key.replace("-", "_")))


def _positive(sglang: Mapping[str, Any], key: str, kind: type, problems: list[str]) -> Any:
    value = _get(sglang, key)
    if value is None:
        return None
    ok = (not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
          and value > 0)
    if not ok:
        what = "a positive integer" if kind is int else "a positive number"
        problems.append(f"sglang.{key}: {value!r} is not {what}")
        return None
    return kind(value)


def _dtypes(sglang: Mapping[str, Any], problems: list[str]) -> tuple[str | None, str | None]:
    """(KV dtype, weight dtype) as plan names them, or None where the file does not say."""
    weights = None
    quant, dtype = _get(sglang, "quantization"), _get(sglang, "dtype")
    if quant is not None:
        weights = _QUANT.get(str(quant).lower())
        if weights is None:
            problems.append(f"sglang.quantization: {quant!r}: plan knows the weight bytes of "
                            f"{', '.join(sorted(_QUANT))}; give --weight-dtype")
    elif dtype not in (None, "auto"):
        try:
            weights = parse_dtype(str(dtype), WEIGHT_DTYPES, "sglang.dtype")
        except ConfigError as e:
            problems.extend(e.problems)
    kv = _get(sglang, "kv-cache-dtype")
    if kv in (None, "auto"):
        kv_dtype = None if dtype in (None, "auto") else canonical(str(dtype))
    else:
        try:
            kv_dtype = parse_dtype(str(kv), KV_DTYPES, "sglang.kv-cache-dtype")
        except ConfigError as e:
            problems.extend(e.problems)
            kv_dtype = None
    return kv_dtype, weights


def from_config(cfg: DeploymentConfig) -> Deployment:
    """The sizing inputs a deployment file sets. Raises ConfigError naming each bad key."""
    s, problems = cfg.sglang, []
    model = _get(s, "model-path")
    if model is not None and not isinstance(model, str):
        problems.append(f"sglang.model-path: {model!r} is not a path or HuggingFace id")
        model = None
    kv_dtype, weight_dtype = _dtypes(s, problems)
    hicache_gb = _positive(s, "hicache-size", float, problems)
    mem_fraction = _positive(s, "mem-fraction-static", float, problems)
    if mem_fraction is not None and mem_fraction > 1:
        problems.append(f"sglang.mem-fraction-static: {mem_fraction:g} is more than 1")
    store = cfg.offload
    if store.transfer.path == "dpu":
        capacity, tier = None, "L3 DPU"
    else:
        capacity, tier = int(store.store.capacity), "L3 NVMe"
    dep = Deployment(
        model=model, tp=_positive(s, "tp-size", int, problems),
        dp=_positive(s, "dp-size", int, problems),
        context=_positive(s, "context-length", int, problems), kv_dtype=kv_dtype,
        weight_dtype=weight_dtype, mem_fraction=mem_fraction,
        page_size=_positive(s, "page-size", int, problems),
        l2_size=None if hicache_gb is None else int(hicache_gb * 1e9),
        l2_ratio=_positive(s, "hicache-ratio", float, problems), tier_capacity=capacity,
        tier_name=tier)
    if problems:
        raise ConfigError(problems)
    return dep
