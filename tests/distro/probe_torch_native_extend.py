"""Probe: torch_native's extend attention (patch 0008), from whichever SGLang is first on sys.path.

    python tests/distro/probe_torch_native_extend.py   # prints PROBE {...}

For each case, the attention shape of a family the E2E tests serve or a mode torch_native keeps
(MHA with GQA; MLA's absorbed latent: one KV head, V narrower than K; a sliding window read
through a full->SWA slot map; cross attention over encoder tokens; encoder-only), a batch of
requests with and without a cached prefix goes through SGLang's own
`TorchNativeAttnBackend._run_sdpa_forward_extend`, in float32 and bfloat16. `probe()` returns per
case and dtype:
- `sdpa`: the (query length, key length) of every `scaled_dot_product_attention` call, counted by
  wrapping the name the backend module calls;
- `extend` / `seq`: each request's new tokens and sequence length;
- `max_diff` and `scale`: the largest difference from the unpatched computation written out here
  (`reference`: every position of the sequence as a query, upstream's masks, the new rows kept),
  and the largest reference value;
- or `error`: the exception (the unpatched upstream has no `kv_loc_map` argument: patch 0007).
"""

from __future__ import annotations

import json
import traceback
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch.nn.functional import scaled_dot_product_attention


@dataclass(frozen=True)
class Case:
    q_heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    prefixes: tuple[int, ...]       # cached tokens per request
    extends: tuple[int, ...]        # new tokens per request
    causal: bool = True
    window: int | None = None       # sliding window (tokens back from each query)
    slot_map: bool = False          # read through a full->SWA slot map (patch 0007)
    encoder: tuple[int, ...] = ()   # encoder tokens per request (cross / self over decoder part)
    cross: bool = False
    mask_elements: int | None = None  # the patched backend's mask budget, small: query blocks


CASES = {
    "mha_gqa": Case(4, 2, 64, 64, prefixes=(0, 192, 700, 64), extends=(130, 64, 1, 37)),
    "mla_absorbed": Case(4, 1, 72, 64, prefixes=(0, 320), extends=(96, 33)),
    "swa_window": Case(4, 2, 32, 32, prefixes=(0, 300, 40), extends=(150, 70, 3), window=48,
                       slot_map=True),
    "cross_attention": Case(2, 2, 32, 32, prefixes=(0, 20), extends=(12, 5), causal=False,
                            encoder=(40, 17), cross=True),
    "encoder_self": Case(2, 2, 32, 32, prefixes=(0, 20), extends=(12, 5), encoder=(40, 17)),
    "encoder_only": Case(2, 2, 32, 32, prefixes=(0,), extends=(90,), causal=False),
    "mha_blocked": Case(4, 2, 64, 64, prefixes=(500, 0), extends=(200, 260), mask_elements=4096),
    "swa_blocked": Case(4, 2, 32, 32, prefixes=(400,), extends=(300,), window=64, slot_map=True,
                        mask_elements=4096),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def reference(q, k_cache, v_cache, tokens, prefix, case: Case, scale, kv_map=None):
    """The unpatched extend of one request, in the inputs' dtype: a query per position of the
    sequence (the prefix's rows zero), upstream's is_causal (top-left on the square) or its S x S
    sliding mask, the new rows kept."""
    if kv_map is not None:
        tokens = kv_map[tokens]
    key, value = k_cache[tokens].movedim(0, 1), v_cache[tokens].movedim(0, 1)
    full = q.new_zeros((q.shape[0], prefix + q.shape[1], q.shape[2]))
    full[:, prefix:] = q
    mask, causal = None, case.causal
    if case.window is not None:
        qp = torch.arange(full.shape[1]).unsqueeze(1)
        kp = torch.arange(key.shape[1]).unsqueeze(0)
        mask, causal = (kp <= qp) & (kp >= qp - case.window), False
    out = scaled_dot_product_attention(full.unsqueeze(0), key.unsqueeze(0),
                                       value.unsqueeze(0), attn_mask=mask,
                                       is_causal=causal, scale=scale,
                                       enable_gqa=case.q_heads != case.kv_heads)
    return out.squeeze(0)[:, prefix:].float()


def run_case(case: Case, dtype: torch.dtype) -> dict:
    from sglang.srt.layers.attention import torch_native_backend as tnb

    gen = torch.Generator().manual_seed(11)
    backend = tnb.TorchNativeAttnBackend(
        SimpleNamespace(device="cpu", req_to_token_pool=None, token_to_kv_pool=None))
    if case.mask_elements is not None:
        backend._MASK_ELEMENTS = case.mask_elements
    n = len(case.prefixes)
    enc = list(case.encoder) or [0] * n
    seqs = [p + e for p, e in zip(case.prefixes, case.extends)]
    slots = 4096
    k_cache = torch.randn(slots, case.kv_heads, case.qk_dim, generator=gen).to(dtype)
    v_cache = torch.randn(slots, case.kv_heads, case.v_dim, generator=gen).to(dtype)
    width = max(e + s for e, s in zip(enc, seqs))
    # scattered slots per request; the slot map (when used) is a permutation of all slots
    perm = torch.randperm(slots, generator=gen)
    req_to_token = perm[: n * width].view(n, width).to(torch.int32)
    kv_map = torch.randperm(slots, generator=gen) if case.slot_map else None
    total = sum(case.extends)
    query = torch.randn(total, case.q_heads, case.qk_dim, generator=gen).to(dtype)
    output = query.new_zeros(total, case.q_heads, case.v_dim)
    scale = case.qk_dim ** -0.5
    calls: list[list[int]] = []
    real = tnb.scaled_dot_product_attention

    def counted(q, k, v, *args, **kwargs):
        calls.append([int(q.shape[-2]), int(k.shape[-2])])
        return real(q, k, v, *args, **kwargs)

    kwargs = {} if kv_map is None else {"kv_loc_map": kv_map}
    tnb.scaled_dot_product_attention = counted
    try:
        backend._run_sdpa_forward_extend(
            query, output, k_cache, v_cache, req_to_token,
            torch.arange(n), torch.tensor(seqs), torch.tensor(case.prefixes),
            torch.tensor(case.extends), torch.tensor(enc) if case.encoder else None,
            scaling=scale, enable_gqa=case.q_heads != case.kv_heads, causal=case.causal,
            is_cross_attn=case.cross, sliding_window_size=case.window, **kwargs)
    finally:
        tnb.scaled_dot_product_attention = real
    diff, top, start = 0.0, 0.0, 0
    for i in range(n):
        first, last = (0, enc[i]) if case.cross else (enc[i], enc[i] + seqs[i])
        tokens = req_to_token[i, first:last]
        q = query[start:start + case.extends[i]].movedim(0, 1)
        want = reference(q, k_cache, v_cache, tokens, case.prefixes[i], case, scale, kv_map)
        got = output[start:start + case.extends[i]].movedim(0, 1).float()
        diff = max(diff, float((got - want).abs().max()))
        top = max(top, float(want.abs().max()))
        start += case.extends[i]
    return {"sdpa": calls, "extend": list(case.extends), "seq": seqs, "max_diff": diff,
            "scale": top}


def probe() -> dict:
    out: dict = {}
    for name, case in CASES.items():
        for dname, dtype in DTYPES.items():
            try:
                out[f"{name}/{dname}"] = run_case(case, dtype)
            except Exception:  # reported to the test, which shows it
                out[f"{name}/{dname}"] = {"error": traceback.format_exc(limit=6)}
    return out


if __name__ == "__main__":
    print("PROBE " + json.dumps(probe()))
