"""Probe: the CPU FP8 KV cache gate (patch 0017), from whichever SGLang is first on sys.path. Run
with SGLANG_USE_CPU_ENGINE=1 (SGLang reads it at import):

    SGLANG_USE_CPU_ENGINE=1 python tests/distro/probe_cpu_fp8_kv.py   # prints PROBE {...}

`probe()` returns:
- `gate`: for every cell of KV dtype x MLA x configured attention backends x AMX present, what
  SGLang's own `KVCacheConfigurator.configure` does before it sizes any pool: "passes", or the
  error it raises (AMX detection and the backend pair are swapped in the module; the configurator
  is a stand-in object that stops `configure` right after the gate);
- `read`: "ok" when `TorchNativeAttnBackend` attends an fp8 K/V cache exactly as the same cache cast
  to bfloat16 (extend with a cached prefix, and decode): fp8 stored, computed in the model dtype.
"""

from __future__ import annotations

import itertools
import json
import traceback
from types import SimpleNamespace

import torch

DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "bfloat16": torch.bfloat16}
BACKENDS = {
    "torch_native": ("torch_native", "torch_native"),
    "intel_amx": ("intel_amx", "intel_amx"),
    "torch_native+intel_amx": ("torch_native", "intel_amx"),
    "triton": ("triton", "triton"),
}


class _PastTheGate(Exception):
    """Raised by the stand-in on the first attribute `configure` reads after the FP8 gate."""


class _Stop:
    def is_none(self) -> bool:
        raise _PastTheGate


def gate_cell(dtype: str, mla: bool, backends: str, amx: bool) -> str:
    from sglang.srt.mem_cache import kv_cache_configurator as kcc

    saved = kcc.cpu_has_amx_support, kcc.attention_backends
    kcc.cpu_has_amx_support = lambda: amx
    kcc.attention_backends = lambda: BACKENDS[backends]
    stand_in = SimpleNamespace(kv_cache_dtype=DTYPES[dtype], use_mla_backend=mla,
                               spec_algorithm=_Stop())
    try:
        kcc.KVCacheConfigurator.configure(stand_in, pre_model_load_memory=0)
    except _PastTheGate:
        return "passes"
    except ValueError as e:
        return f"ValueError: {e}"
    finally:
        kcc.cpu_has_amx_support, kcc.attention_backends = saved
    return "returned"


def check_read() -> None:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    backend = object.__new__(TorchNativeAttnBackend)
    gen = torch.Generator().manual_seed(5)
    slots, heads, kv_heads, dim = 32, 4, 2, 16
    k8 = (torch.randn(slots, kv_heads, dim, generator=gen) * 2).to(torch.float8_e4m3fn)
    v8 = (torch.randn(slots, kv_heads, dim, generator=gen) * 2).to(torch.float8_e4m3fn)
    k16, v16 = k8.to(torch.bfloat16), v8.to(torch.bfloat16)
    req_to_token = torch.randperm(slots, generator=gen).reshape(2, 16).to(torch.int32)
    pools = torch.tensor([1, 0])
    seq_lens = torch.tensor([16, 12])
    prefix = torch.tensor([10, 0])
    extend = seq_lens - prefix
    q = torch.randn(int(extend.sum()), heads, dim, generator=gen).to(torch.bfloat16)
    outs = []
    for k, v in ((k8, v8), (k16, v16)):
        o = torch.empty_like(q)
        backend._run_sdpa_forward_extend(q, o, k, v, req_to_token, pools, seq_lens, prefix, extend,
                                         scaling=dim ** -0.5, enable_gqa=True, causal=True)
        qd = q[:2].clone()
        od = torch.empty_like(qd)
        backend._run_sdpa_forward_decode(qd, od, k, v, req_to_token, pools, seq_lens,
                                         scaling=dim ** -0.5, enable_gqa=True)
        outs.append((o, od))
    for got, want in zip(outs[0], outs[1]):
        if got.dtype != torch.bfloat16 or not torch.equal(got, want):
            raise AssertionError("fp8 K/V are not attended as their bfloat16 values")


def probe() -> dict:
    gate = {f"{dtype}/{'mla' if mla else 'mha'}/{backends}/{'amx' if amx else 'no-amx'}":
            gate_cell(dtype, mla, backends, amx)
            for dtype, mla, backends, amx in itertools.product(DTYPES, (False, True), BACKENDS,
                                                               (False, True))}
    try:
        check_read()
        read = "ok"
    except Exception:  # reported to the test, which shows it
        read = "error: " + traceback.format_exc(limit=6)
    return {"gate": gate, "read": read}


if __name__ == "__main__":
    print("PROBE " + json.dumps(probe()))
