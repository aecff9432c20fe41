"""The worth-it rule: a load that would take longer than recomputing the prefix is skipped.

Primitives:
- `Ewma`: exponentially weighted moving average of the tier's read bandwidth (bytes/s), fed with
  the bytes and seconds of every real batch load (`batch_get_v1`).
- `estimate_prefill_tps(model, gpu_name, tp_size)`: the `plan` module's estimate of prefill
  speed (tokens/s of one replica) when none is configured, or (None, why) if the model or GPU
  is unknown.
- `WorthIt(cfg, prefill_tps)`: `pages_to_load(hit_pages, page_tokens, page_bytes)` -> how many of
  the leading hit pages SGLang should load; `observe(bytes, seconds)` after each load.

The rule (`offload.plan.worth_loading`): loading n pages takes n x page_bytes / bandwidth, and
recomputing them n x page_tokens / prefill_tps. Both grow linearly with n, so the answer is all
of the leading hits or none. Before the first measurement every hit is accepted (that is how the
bandwidth gets measured); when hits have been declined for `probe_s` without a new measurement,
one batch is let through to measure again, so a tier that became fast is noticed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from offload.config import WorthItConfig
from offload.plan.model import worth_loading

log = logging.getLogger(__name__)

DEFAULT_ALPHA = 0.2        # weight of the newest sample
DEFAULT_PROBE_S = 30.0     # re-measure a declined tier this often
ESTIMATE_CONTEXT = 32768   # tokens of context assumed for the attention share of prefill FLOPs


class Ewma:
    """Moving average of bytes/s over calls; thread safe."""

    def __init__(self, alpha: float = DEFAULT_ALPHA):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha {alpha}: must be in (0, 1]")
        self.alpha = alpha
        self.value: float | None = None
        self._lock = threading.Lock()

    def observe(self, nbytes: int, seconds: float) -> float | None:
        if nbytes <= 0 or seconds <= 0:
            return self.value
        rate = nbytes / seconds
        with self._lock:
            self.value = rate if self.value is None else (
                self.alpha * rate + (1 - self.alpha) * self.value)
            return self.value


def _gpu_preset_name(gpu_name: str) -> str | None:
    low = gpu_name.lower()
    return next((g for g in ("b200", "h200", "h100") if g in low), None)


def estimate_prefill_tps(model: str, gpu_name: str | None, tp_size: int = 1,
                         context: int = ESTIMATE_CONTEXT) -> tuple[float | None, str]:
    """(prefill tokens/s of one replica of tp_size GPUs, how it was found) or (None, why not)."""
    from offload.errors import ConfigError
    from offload.plan.model import DEFAULT_MFU, prefill_flops_per_token
    from offload.plan.presets import find_gpu, find_model, load_architecture

    if not gpu_name:
        return None, "no GPU visible"
    gpu = find_gpu(_gpu_preset_name(gpu_name) or gpu_name)
    if gpu is None:
        return None, f"GPU {gpu_name!r} has no preset"
    arch = None
    candidates = [model, model.rstrip("/").rsplit("/", 1)[-1]]
    candidates.append(candidates[-1].removesuffix("-Instruct"))
    for name in candidates:
        if not name or (name != model and find_model(name) is None):
            continue
        try:
            arch, _ = load_architecture(name)
            break
        except ConfigError:
            continue
    if arch is None:
        return None, f"model {model!r} is neither a preset nor a directory with config.json"
    per_gpu = gpu.bf16_tflops * 1e12 * DEFAULT_MFU / prefill_flops_per_token(arch, context)
    return per_gpu * tp_size, (f"estimated: {DEFAULT_MFU:.0%} of {gpu.bf16_tflops:g} TFLOPS "
                               f"({gpu.name}) x {tp_size} GPU(s), {arch.name}, {context}-token "
                               "context")


class WorthIt:
    """Decides how many leading hit pages to report; see the module docstring."""

    def __init__(self, cfg: WorthItConfig, prefill_tps: float | None, source: str = "",
                 *, alpha: float = DEFAULT_ALPHA, probe_s: float = DEFAULT_PROBE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.enabled = cfg.enabled and prefill_tps is not None and prefill_tps > 0
        self.prefill_tps = prefill_tps
        self.source = source
        self.bandwidth = Ewma(alpha)
        self.probe_s = probe_s
        self._clock = clock
        self._last_sample = clock()
        self.declined = 0
        if cfg.enabled and not self.enabled:
            log.warning("offload: worth-it rule off: no prefill speed (%s); set "
                        "offload.worth_it.prefill_tokens_per_s", source or "not configured")

    def observe(self, nbytes: int, seconds: float) -> float | None:
        """One real load of `nbytes` in `seconds`; returns the new average bytes/s."""
        self._last_sample = self._clock()
        return self.bandwidth.observe(nbytes, seconds)

    def pages_to_load(self, hit_pages: int, page_tokens: int, page_bytes: int) -> int:
        bw, tps = self.bandwidth.value, self.prefill_tps
        if not self.enabled or tps is None or bw is None or hit_pages <= 0 or page_tokens <= 0:
            return hit_pages
        if worth_loading(hit_pages * page_tokens, page_bytes / page_tokens, bw / 1e9, tps):
            return hit_pages
        if self._clock() - self._last_sample >= self.probe_s:
            self._last_sample = self._clock()   # one batch through, to measure the tier again
            return hit_pages
        self.declined += hit_pages
        return 0


def from_config(cfg: WorthItConfig, model: str, tp_size: int,
                gpu_name: Callable[[], str | None]) -> WorthIt:
    """The rule for one backend: the configured prefill speed, else the plan estimate."""
    if cfg.prefill_tokens_per_s is not None:
        return WorthIt(cfg, cfg.prefill_tokens_per_s, "configured")
    if not cfg.enabled:
        return WorthIt(cfg, None, "disabled")
    tps, source = estimate_prefill_tps(model, gpu_name(), tp_size)
    return WorthIt(cfg, tps, source)


def cuda_gpu_name() -> str | None:
    """Name of the current CUDA device, or None without one (torch is already loaded by SGLang)."""
    try:
        import torch

        if torch.cuda.is_available():
            return str(torch.cuda.get_device_name(torch.cuda.current_device()))
    except Exception:  # noqa: BLE001 - no GPU is an answer, not an error
        log.debug("no CUDA device name", exc_info=True)
    return None


__all__ = ["Ewma", "WorthIt", "cuda_gpu_name", "estimate_prefill_tps", "from_config"]
