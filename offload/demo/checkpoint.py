"""Write the demo checkpoint: `write_demo(directory, spec) -> list of files written`.

Files: config.json (LlamaForCausalLM), generation_config.json (greedy), model.safetensors (random
normal(0, 0.02) weights, norms at 1, from `spec.seed`), tokenizer.json, tokenizer_config.json and a
README.md that says the weights are random. Refuses a non-empty directory unless `overwrite`.
Same spec, same bytes: one CPU generator, sorted tensor names, fixed JSON formatting.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from offload.demo.spec import DemoSpec
from offload.demo.tokenizer import BOS, EOS, build_tokenizer, tokenizer_config
from offload.errors import ConfigError

NOTICE = ("RANDOM WEIGHTS: a demo model written by `sglang-offload demo-model`. The text it "
          "generates is gibberish; the KV path (prefill, radix cache, HiCache, the offload tier) "
          "is the real one. Point sglang.model-path at real weights for real text.")


def _config(spec: DemoSpec, vocab: int, bos: int, eos: int) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": spec.hidden, "intermediate_size": spec.intermediate,
            "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim,
            "hidden_act": "silu", "max_position_embeddings": spec.context,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": None,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "vocab_size": vocab, "bos_token_id": bos, "eos_token_id": eos,
            "torch_dtype": spec.dtype, "_name_or_path": "sglang-offload-demo", "_comment": NOTICE}


def _weights(spec: DemoSpec, vocab: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    h, d, kv = spec.hidden, spec.head_dim, spec.kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h),
                                          "lm_head.weight": (vocab, h)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (spec.heads * d, h),
                   p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                   p + "self_attn.o_proj.weight": (h, spec.heads * d),
                   p + "mlp.gate_proj.weight": (spec.intermediate, h),
                   p + "mlp.up_proj.weight": (spec.intermediate, h),
                   p + "mlp.down_proj.weight": (h, spec.intermediate),
                   p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    shapes["model.norm.weight"] = (h,)
    out = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shapes[name], dtype=dtype)
        else:
            out[name] = (torch.randn(shapes[name], generator=g) * 0.02).to(dtype)
    return out


def _dump(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_demo(directory: str | Path, spec: DemoSpec, overwrite: bool = False) -> list[Path]:
    """Write the checkpoint into `directory` (created). Raises ConfigError before writing."""
    spec.check()
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise ConfigError([f"DIR: {out} is not a directory; name a new or empty directory"])
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError([f"DIR: {out} is not empty; name a new or empty directory, or pass "
                           "--force to overwrite the demo files in it"])
    from safetensors.torch import save_file

    tok = build_tokenizer(spec.vocab)
    bos, eos = tok.token_to_id(BOS) or 0, tok.token_to_id(EOS) or 1   # the first two tokens
    vocab = -(-tok.get_vocab_size() // 64) * 64
    try:
        out.mkdir(parents=True, exist_ok=True)
        files = [out / n for n in ("config.json", "generation_config.json", "model.safetensors",
                                   "tokenizer.json", "tokenizer_config.json", "README.md")]
        _dump(files[0], _config(spec, vocab, bos, eos))
        _dump(files[1], {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False,
                         "pad_token_id": eos})
        save_file(_weights(spec, vocab), str(files[2]), metadata={"format": "pt"})  # one key:
        # safetensors writes metadata in hash order
        tok.save(str(files[3]))
        _dump(files[4], tokenizer_config(spec.context))
        files[5].write_text(f"# sglang-offload demo model\n\n{NOTICE}\n\nShape: {spec}\n")
    except OSError as e:
        raise ConfigError([f"DIR: cannot write {out}: {e.strerror or e}; name a writable "
                           "directory"]) from e
    return files
