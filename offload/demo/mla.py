"""An MLA demo model: `write_mla_demo(DIR, DemoSpec)`, a tiny DeepSeek-V2-architecture checkpoint.

Multi-head latent attention (MLA) caches one latent row per token (`kv_lora_rank` + the RoPE part)
instead of per-head K and V: SGLang serves it with its MLA KV pool and HiCache's MLA host pool,
one store block per page shared by every TP rank. Same tokenizer and files as the Llama demo
(`offload.demo.write_demo`), RANDOM weights (gibberish text, the real KV path), a dense MLP in
every layer (no MoE), `q_lora_rank` null (a plain q projection). On the CPU engine SGLang builds
RoPE only for `rope_type: deepseek_yarn` (srt/layers/rotary_embedding/factory.py, `get_rope_cpu`):
the config asks for it with factor 1 (plain RoPE). Serving it with `torch_native` attention needs
patches/0006 (the absorbed MLA path on every pass).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

from offload.demo.checkpoint import write_demo
from offload.demo.spec import DemoSpec

KV_LORA_RANK = 128
ROPE_DIM = 64


def _config(spec: DemoSpec, base: dict[str, Any]) -> dict[str, Any]:
    cfg = {k: v for k, v in base.items() if k != "head_dim"}
    cfg.update({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                "num_key_value_heads": spec.heads, "kv_lora_rank": KV_LORA_RANK,
                "q_lora_rank": None, "qk_nope_head_dim": spec.head_dim,
                "qk_rope_head_dim": ROPE_DIM, "v_head_dim": spec.head_dim,
                # every layer dense (first_k_dense_replace); the MoE fields must still parse
                "first_k_dense_replace": spec.layers, "moe_layer_freq": 1,
                "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
                "moe_intermediate_size": spec.intermediate, "topk_method": "greedy",
                "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
                "scoring_func": "softmax", "routed_scaling_factor": 1.0,
                "rope_scaling": {"rope_type": "deepseek_yarn", "type": "yarn", "factor": 1.0,
                                 "original_max_position_embeddings": spec.context,
                                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                 "mscale_all_dim": 1.0}})
    return cfg


def _weights(spec: DemoSpec, vocab: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    h, d, heads = spec.hidden, spec.head_dim, spec.heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h),
                                          "lm_head.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (heads * (d + ROPE_DIM), h),
                   p + "self_attn.kv_a_proj_with_mqa.weight": (KV_LORA_RANK + ROPE_DIM, h),
                   p + "self_attn.kv_a_layernorm.weight": (KV_LORA_RANK,),
                   p + "self_attn.kv_b_proj.weight": (heads * 2 * d, KV_LORA_RANK),
                   p + "self_attn.o_proj.weight": (h, heads * d),
                   p + "mlp.gate_proj.weight": (spec.intermediate, h),
                   p + "mlp.up_proj.weight": (spec.intermediate, h),
                   p + "mlp.down_proj.weight": (h, spec.intermediate),
                   p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    return {name: torch.ones(shapes[name], dtype=dtype) if name.endswith("norm.weight")
            else (torch.randn(shapes[name], generator=g) * 0.02).to(dtype)
            for name in sorted(shapes)}


def write_mla_demo(directory: str | Path, spec: DemoSpec, overwrite: bool = False) -> list[Path]:
    """The Llama demo's files with an MLA config.json and weights. Raises ConfigError first."""
    return write_demo(directory, spec, overwrite=overwrite, adjust=partial(_mla, spec))


def _mla(spec: DemoSpec, stage: Path) -> None:
    """The staged Llama files made an MLA model's: its config.json and weights."""
    from safetensors.torch import save_file

    config, weights = stage / "config.json", stage / "model.safetensors"
    base = json.loads(config.read_text())
    config.write_text(json.dumps(_config(spec, base), indent=2, sort_keys=True) + "\n")
    save_file(_weights(spec, int(base["vocab_size"])), str(weights), metadata={"format": "pt"})
