"""The worth-it rule: a load that would take longer than recomputing the prefix is skipped.

Primitives:
- `Ewma`: exponentially weighted moving average of the tier's read bandwidth (bytes/s), fed with
  the bytes and seconds of every real batch load (`batch_get_v1`); `Mean`: the same over plain
  values (seconds); `WindowMax`: the largest of the last 16 values (the measured prefill speed).
- `estimate_prefill_tps(model, gpu_name, tp_size)`: the `plan` module's estimate of prefill
  speed (tokens/s of one replica) when none is configured, or (None, why) if the model or GPU
  is unknown.
- `WorthIt(cfg, prefill_tps)`: `pages_to_load(hit_pages, page_tokens, page_bytes)` -> how many of
  the leading hit pages SGLang should load; `observe(bytes, seconds)` after each load; the
  measurements of the backend's calls: `note_query(keys, hits, accepted, page_tokens)` (every
  `batch_exists`), `note_stored(keys)` (every KV write-back), `note_loaded(keys)` (every KV load);
  `threshold_tokens()`: the break-even hit size now, None while unknown.
- `plan_text(cfg, device, store)`: what the rule will use, for `launch`'s decision (`store`: the
  store's drives and combined read bandwidth, the ceiling of the measured one).

The rule: loading n pages takes `overhead + n x page_bytes / bandwidth`, recomputing them
`n x page_tokens / prefill_tps`; the leading hits are loaded when loading is faster, all or none.
`overhead` is the fixed cost of one hit on SGLang's prefetch path (query, prefetch thread, the
wait for its completion), measured per hit from `batch_exists` to the load of its last page, less
its bytes at the measured bandwidth: it is what makes a small hit cost more than it saves. So
hits below `overhead / (page_tokens/prefill_tps - page_bytes/bandwidth)` pages are recomputed
(`threshold_tokens`), and a tier slower than prefill per page is never worth loading.

The prefill speed is the configured one, else the plan estimate (a known GPU and model), else
measured from the first requests on any device: a query that reports no hit (every page
computed) is matched with the write-back of its first page (SGLang backs the prefix up right
after its prefill), and `(pages x page_tokens) / (write-back - query)` is one sample. The queue
wait and the write-back latency are inside every sample, so each errs slow: the speed used is the
largest of the last 16 (`WindowMax`; a first request slowed by SGLang's JIT build does not stick).
Until a prefill speed and a bandwidth are known every hit is loaded (that is how they
get measured); when hits have been declined for `probe_s` without a new load, one batch is let
through to measure again, so a tier that became fast is noticed.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

from offload.config import WorthItConfig

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


class Mean:
    """Moving average of plain values (seconds, tokens/s); thread safe."""

    def __init__(self, alpha: float = DEFAULT_ALPHA):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha {alpha}: must be in (0, 1]")
        self.alpha = alpha
        self.value: float | None = None
        self.samples = 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> float:
        with self._lock:
            self.value = value if self.value is None else (
                self.alpha * value + (1 - self.alpha) * self.value)
            self.samples += 1
            return self.value


class WindowMax:
    """The largest of the last `n` values; thread safe. For a speed whose every sample can only
    be slower than the truth (queue waits, write-back latency), the largest is the best guess."""

    def __init__(self, n: int = 16):
        self._values: deque[float] = deque(maxlen=n)
        self.samples = 0
        self._lock = threading.Lock()

    @property
    def value(self) -> float | None:
        with self._lock:
            return max(self._values) if self._values else None

    def observe(self, value: float) -> float | None:
        with self._lock:
            self._values.append(value)
            self.samples += 1
        return self.value


PENDING = 256              # queries remembered until their write-back or load


class WorthIt:
    """Decides how many leading hit pages to report; see the module docstring."""

    def __init__(self, cfg: WorthItConfig, prefill_tps: float | None, source: str = "",
                 *, alpha: float = DEFAULT_ALPHA, probe_s: float = DEFAULT_PROBE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.enabled = cfg.enabled
        self.fixed_tps = prefill_tps if prefill_tps is not None and prefill_tps > 0 else None
        self.source = source if self.fixed_tps is not None else (
            f"measured from the first requests ({source})" if source else
            "measured from the first requests")
        self.bandwidth = Ewma(alpha)
        self.measured_tps = WindowMax()     # prefill tokens/s from misses and their write-back
        self.overhead = Mean(alpha)         # seconds of one hit beyond its bytes
        self.probe_s = probe_s
        self._clock = clock
        self._last_sample = clock()
        self.declined = 0
        self.declined_hits = 0
        self._misses: dict[str, tuple[float, int]] = {}   # first missed key -> (t, tokens)
        self._hits: dict[str, tuple[float, int, int]] = {}  # last hit key -> (t, pages, bytes)
        self._page_bytes = 0
        self._page_tokens = 0
        self._said: int | None = None
        self._lock = threading.Lock()
        if self.enabled:
            log.info("offload: worth-it rule on, prefill speed %s", self.describe_source())

    @property
    def prefill_tps(self) -> float | None:
        return self.fixed_tps if self.fixed_tps is not None else self.measured_tps.value

    def describe_source(self) -> str:
        if self.fixed_tps is not None:
            return f"{self.fixed_tps:,.0f} tokens/s ({self.source})"
        return self.source

    def observe(self, nbytes: int, seconds: float) -> float | None:
        """One real load of `nbytes` in `seconds`; returns the new average bytes/s."""
        self._last_sample = self._clock()
        return self.bandwidth.observe(nbytes, seconds)

    # ------------------------------------------------------------ measurements of the calls

    def note_query(self, keys: Sequence[str], hits: int, accepted: int, page_tokens: int,
                   page_bytes: int = 0) -> None:
        """A `batch_exists` over `keys`: `hits` leading pages stored, `accepted` reported."""
        if not self.enabled or not keys or page_tokens <= 0:
            return
        now = self._clock()
        with self._lock:
            self._page_tokens = page_tokens
            # all computed (after a hit, the load would be in the time); the earliest query of
            # a key is kept, so a shared prefix never makes a prefill look faster than it was
            if accepted == 0 and keys[0] not in self._misses:
                _remember(self._misses, keys[0], (now, len(keys) * page_tokens))
            if accepted > 0:
                _remember(self._hits, keys[accepted - 1],
                          (now, accepted, accepted * (page_bytes or self._page_bytes)))

    def note_stored(self, keys: Sequence[str]) -> None:
        """A KV write-back of `keys`: closes the prefill of a miss whose first page is in it."""
        if not self._misses:
            return
        now = self._clock()
        with self._lock:
            found = [self._misses.pop(k) for k in keys if k in self._misses]
        for t, tokens in found:
            if now > t and tokens > 0:
                self.measured_tps.observe(tokens / (now - t))
        if found:
            self._say()

    def note_loaded(self, keys: Sequence[str], page_bytes: int = 0) -> None:
        """A KV load of `keys`: closes a hit whose last page is in it (its fixed cost)."""
        if page_bytes:
            self._page_bytes = page_bytes
        if not self._hits:
            return
        now = self._clock()
        with self._lock:
            found = [self._hits.pop(k) for k in keys if k in self._hits]
        bw = self.bandwidth.value
        for t, _pages, nbytes in found:
            moving = nbytes / bw if bw else 0.0
            self.overhead.observe(max(now - t - moving, 0.0))
        if found:
            self._say()

    # ------------------------------------------------------------ the rule

    def threshold_tokens(self, page_tokens: int = 0, page_bytes: int = 0) -> float | None:
        """Hits of fewer tokens than this are recomputed (inf: never loaded); None: not known."""
        page_tokens = page_tokens or self._page_tokens
        page_bytes = page_bytes or self._page_bytes
        tps, bw = self.prefill_tps, self.bandwidth.value
        if tps is None or bw is None or page_tokens <= 0:
            return None
        gain = page_tokens / tps - page_bytes / bw       # seconds saved per page, bytes aside
        if gain <= 0:
            return math.inf
        return (self.overhead.value or 0.0) / gain * page_tokens

    def pages_to_load(self, hit_pages: int, page_tokens: int, page_bytes: int) -> int:
        bw, tps = self.bandwidth.value, self.prefill_tps
        if not self.enabled or tps is None or bw is None or hit_pages <= 0 or page_tokens <= 0:
            return hit_pages
        load_s = (self.overhead.value or 0.0) + hit_pages * page_bytes / bw
        if load_s < hit_pages * page_tokens / tps:
            return hit_pages
        if self._clock() - self._last_sample >= self.probe_s:
            self._last_sample = self._clock()   # one batch through, to measure the tier again
            return hit_pages
        self.declined += hit_pages
        self.declined_hits += 1
        return 0

    def _say(self) -> None:
        """Log the break-even hit size when it is first known and when it moves by a page."""
        t = self.threshold_tokens()
        if t is None:
            return
        pages = -1 if math.isinf(t) else int(t // max(self._page_tokens, 1))
        if pages == self._said:
            return
        self._said = pages
        tps, bw, ov = self.prefill_tps, self.bandwidth.value, self.overhead.value or 0.0
        what = "never load" if pages < 0 else f"{t:,.0f} tokens"
        how = "configured" if self.fixed_tps is not None else "measured"
        log.info("offload: worth-it threshold %s (prefill %s tokens/s %s, load %.3f s per hit "
                 "+ %.2f GB/s)", what, f"{tps or 0.0:,.0f}", how, ov, (bw or 0.0) / 1e9)


def _remember(table: dict, key: str, value: Any) -> None:
    table[key] = value
    while len(table) > PENDING:
        table.pop(next(iter(table)))


def from_config(cfg: WorthItConfig, model: str, tp_size: int,
                gpu_name: Callable[[], str | None]) -> WorthIt:
    """The rule for one backend: the configured prefill speed, else the plan estimate, else
    measured from the first requests."""
    if cfg.prefill_tokens_per_s is not None:
        return WorthIt(cfg, cfg.prefill_tokens_per_s, "configured")
    if not cfg.enabled:
        return WorthIt(cfg, None, "disabled")
    tps, source = estimate_prefill_tps(model, gpu_name(), tp_size)
    return WorthIt(cfg, tps, source)


def plan_text(cfg: WorthItConfig, device: str, store: str = "") -> str:
    """What the rule will use on `device` (launch's decision; the backend logs the figures).
    `store`: the store's drives and their combined read bandwidth (the decision's), named as
    the ceiling of what will be measured: the bandwidth is measured over whole loads, which
    spread over every directory of the store."""
    if not cfg.enabled:
        return "worth-it rule off (offload.worth_it.enabled: false): every L3 hit is loaded"
    how = ("hits smaller than the break-even (load overhead / (recompute - read time) per "
           "page) are recomputed; the backend logs the threshold once measured")
    measured = "load overhead and bandwidth measured" + (
        f" (the store's reads span {store}, at most)" if store else "")
    if cfg.prefill_tokens_per_s is not None:
        return (f"worth-it rule: prefill {cfg.prefill_tokens_per_s:,.0f} tokens/s (configured), "
                f"{measured}; {how}")
    where = ("on device cpu no preset applies" if device == "cpu" else
             "the plan estimate where the model and GPU have presets")
    return (f"worth-it rule: prefill speed {where}, otherwise measured from the first requests "
            f"(a miss's query to its write-back), {measured}; {how}")


def cuda_gpu_name() -> str | None:
    """Name of the current CUDA device, or None without one (torch is already loaded by SGLang)."""
    try:
        import torch

        if torch.cuda.is_available():
            return str(torch.cuda.get_device_name(torch.cuda.current_device()))
    except Exception:  # noqa: BLE001 - no GPU is an answer, not an error
        log.debug("no CUDA device name", exc_info=True)
    return None


__all__ = ["Ewma", "Mean", "WindowMax", "WorthIt", "cuda_gpu_name", "estimate_prefill_tps",
           "from_config", "plan_text"]
