"""A sliding-window hybrid demo model: `write_swa_demo(DIR, DemoSpec)`, a tiny Mellum checkpoint.

Mellum (`MellumForCausalLM`, in SGLang's hybrid-SWA list) alternates sliding-window and full
attention layers (`layer_types`). SGLang serves it with its hybrid SWA KV pool: the full layers'
K/V in one pool, the sliding layers' in an SWA pool that keeps only the last `sliding_window`
tokens; HiCache registers the SWA host pool as the `swa` sidecar, stored for the trailing pages
of a prefix. The files are the Llama demo's (`offload.demo.write_demo`: same tokenizer, RANDOM
weights) plus the per-head q/k RMS norms Mellum has, with a Mellum config.json: every MLP dense.
Serving it with `torch_native` attention needs patches/0007 (SWA layers read at their SWA slots).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

from offload.demo.checkpoint import write_demo
from offload.demo.spec import DemoSpec

WINDOW = 256                      # tokens: 4 pages of 64, well inside a ~1K-token test prompt


def _config(spec: DemoSpec, base: dict[str, Any]) -> dict[str, Any]:
    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
            "rms_norm_eps", "attention_bias", "tie_word_embeddings", "vocab_size",
            "bos_token_id", "eos_token_id", "torch_dtype", "_name_or_path", "_comment")
    cfg = {k: base[k] for k in keep if k in base}
    cfg.update({"architectures": ["MellumForCausalLM"], "model_type": "mellum",
                "sliding_window": WINDOW,
                "layer_types": [("sliding_attention", "full_attention")[i % 2]
                                for i in range(spec.layers)],
                "mlp_layer_types": ["dense"] * spec.layers,
                # parsed even when every MLP is dense
                "num_local_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": spec.intermediate, "norm_topk_prob": True,
                "rope_parameters": {"full_attention": {"rope_type": "default",
                                                       "rope_theta": 500000.0},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0}}})
    return cfg


def write_swa_demo(directory: str | Path, spec: DemoSpec, overwrite: bool = False) -> list[Path]:
    """The Llama demo's files with a Mellum config.json and q/k norms. Raises ConfigError first."""
    return write_demo(directory, spec, overwrite=overwrite, adjust=partial(_mellum, spec))


def _mellum(spec: DemoSpec, stage: Path) -> None:
    """The staged Llama files made Mellum's: its config.json, q/k norms added to the weights."""
    import torch
    from safetensors.torch import load_file, save_file

    config, weights = stage / "config.json", stage / "model.safetensors"
    config.write_text(json.dumps(_config(spec, json.loads(config.read_text())), indent=2,
                                 sort_keys=True) + "\n")
    tensors = load_file(str(weights))
    for i in range(spec.layers):
        for norm in ("q_norm", "k_norm"):
            tensors[f"model.layers.{i}.self_attn.{norm}.weight"] = torch.ones(
                spec.head_dim, dtype=getattr(torch, spec.dtype))
    save_file({k: tensors[k] for k in sorted(tensors)}, str(weights), metadata={"format": "pt"})
