"""Models and GPUs for `sglang-offload plan`: presets and HuggingFace config.json parsing.

Primitives: `Architecture` (what KV sizing and prefill FLOPs need), built by
`architecture_from_config(hf_config)` (errors name the missing key) or `load_architecture(name or
path)`; `estimate_params(hf_config)` when no parameter count is given; `MODELS` (name ->
`ModelPreset`: the subset of the model's HuggingFace `config.json` that plan reads, copied
verbatim, plus its published parameter count) and `GPUS`
(name -> `GpuPreset`: memory as the driver reports it, dense BF16 tensor throughput). Lookup is
case-insensitive and ignores `-`, `_`, `.` and spaces (`llama3.1-70b`, `B200-192G`, `h100`).
Presets go through the same parser as a user's config.json. Nothing heavy is imported.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from offload.errors import ConfigError


@dataclass(frozen=True)
class ModelPreset:
    name: str
    config: Mapping[str, Any]      # keys as in the HF config.json (only those plan reads)
    params: int                    # published total parameter count
    source: str                    # where the numbers come from


@dataclass(frozen=True)
class GpuPreset:
    name: str
    memory_bytes: int              # total HBM as nvidia-smi reports it (MiB x 2**20)
    bf16_tflops: float             # dense (not sparse) BF16 tensor-core peak, per GPU
    note: str


_LLAMA31 = {"model_type": "llama", "vocab_size": 128256, "tie_word_embeddings": False,
            "head_dim": 128, "num_key_value_heads": 8, "max_position_embeddings": 131072}

MODELS: dict[str, ModelPreset] = {p.name: p for p in (
    ModelPreset("Llama-3.1-8B", {**_LLAMA31, "num_hidden_layers": 32, "hidden_size": 4096,
                                 "num_attention_heads": 32, "intermediate_size": 14336},
                8_030_261_248, "meta-llama/Llama-3.1-8B config.json; 8.03B params"),
    ModelPreset("Llama-3.1-70B", {**_LLAMA31, "num_hidden_layers": 80, "hidden_size": 8192,
                                  "num_attention_heads": 64, "intermediate_size": 28672},
                70_553_706_496, "meta-llama/Llama-3.1-70B config.json; 70.6B params"),
    ModelPreset("Llama-3.1-405B", {**_LLAMA31, "num_hidden_layers": 126, "hidden_size": 16384,
                                   "num_attention_heads": 128, "intermediate_size": 53248},
                405_853_388_800, "meta-llama/Llama-3.1-405B config.json; 405.9B params"),
    ModelPreset("Qwen2.5-72B", {"model_type": "qwen2", "num_hidden_layers": 80, "hidden_size": 8192,
                                "num_attention_heads": 64, "num_key_value_heads": 8,
                                "intermediate_size": 29568, "vocab_size": 152064,
                                "tie_word_embeddings": False,
                                "max_position_embeddings": 32768},
                72_706_203_648, "Qwen/Qwen2.5-72B config.json; 72.7B params"),
    ModelPreset("Mixtral-8x7B", {"model_type": "mixtral", "num_hidden_layers": 32,
                                 "hidden_size": 4096, "num_attention_heads": 32,
                                 "num_key_value_heads": 8, "intermediate_size": 14336,
                                 "num_local_experts": 8, "num_experts_per_tok": 2,
                                 "vocab_size": 32000, "tie_word_embeddings": False,
                                 "max_position_embeddings": 32768},
                46_702_792_704, "mistralai/Mixtral-8x7B-v0.1 config.json; 46.7B params "
                "(12.9B active)"),
    ModelPreset("DeepSeek-V3", {"model_type": "deepseek_v3", "num_hidden_layers": 61,
                                "hidden_size": 7168, "num_attention_heads": 128,
                                "num_key_value_heads": 128, "q_lora_rank": 1536,
                                "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                                "qk_rope_head_dim": 64, "v_head_dim": 128,
                                "intermediate_size": 18432, "moe_intermediate_size": 2048,
                                "n_routed_experts": 256, "n_shared_experts": 1,
                                "num_experts_per_tok": 8, "first_k_dense_replace": 3,
                                "vocab_size": 129280, "tie_word_embeddings": False,
                                "max_position_embeddings": 163840},
                671_026_419_200, "deepseek-ai/DeepSeek-V3 config.json; 671B params (37B "
                "active), the 14B multi-token-prediction module not counted"),
)}

# Memory: the total nvidia-smi prints for each part (MiB), so "80G" is what the driver gives.
GPUS: dict[str, GpuPreset] = {p.name: p for p in (
    GpuPreset("H100-80G", 81559 << 20, 989.0, "H100 SXM 80GB: 81559 MiB, 989 TFLOPS dense BF16"),
    GpuPreset("H200-141G", 143771 << 20, 989.0, "H200 141GB: 143771 MiB, 989 TFLOPS dense BF16"),
    GpuPreset("B200-192G", 183359 << 20, 2250.0, "B200 192GB: 183359 MiB, 2250 TFLOPS dense BF16"),
)}

_GPU_ALIASES = {"h100": "H100-80G", "h200": "H200-141G", "b200": "B200-192G"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.\s]", "", name).lower()


# What a HuggingFace repo id adds to a preset's name: `meta-llama/Llama-3.1-70B-Instruct`,
# `mistralai/Mixtral-8x7B-Instruct-v0.1`, `Qwen/Qwen2.5-72B-Instruct`, `...-FP8`.
_ID_SUFFIX = re.compile(r"(-(instruct|chat|base|fp8|v\d+(\.\d+)*|\d{4}))+$", re.IGNORECASE)


def find_model(name: str) -> ModelPreset | None:
    """The model preset called `name` (case and punctuation ignored) or named by a HuggingFace
    repo id (`meta-llama/Llama-3.1-70B-Instruct`: the organisation and the variant suffixes
    -Instruct, -Chat, -Base, -FP8, -v0.1, -2407 dropped), or None."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    for want in dict.fromkeys((_norm(base), _norm(_ID_SUFFIX.sub("", base)))):
        found = next((p for n, p in MODELS.items() if _norm(n) == want), None)
        if found is not None:
            return found
    return None


def gpu_from_device_name(device_name: str) -> GpuPreset | None:
    """The preset of a GPU as the driver names it (`NVIDIA H100 80GB HBM3`), or None."""
    low = device_name.lower()
    return next((p for key, p in ((k, GPUS[v]) for k, v in _GPU_ALIASES.items()) if key in low),
                None)


def find_gpu(name: str) -> GpuPreset | None:
    """The GPU preset called `name` (`B200`, `b200-192g`, ...), or None."""
    want = _norm(name)
    for n, p in GPUS.items():
        if _norm(n) == want:
            return p
    alias = _GPU_ALIASES.get(want)
    return GPUS[alias] if alias else None


@dataclass(frozen=True)
class Architecture:
    name: str
    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    params: int
    active_params: int          # per token (MoE: routed experts used + shared); dense: = params
    kv_lora_rank: int = 0       # > 0 means MLA
    qk_rope_head_dim: int = 0
    attn_qk_dim: int = 0        # per-head dims for the attention FLOPs (QK^T and AV)
    attn_v_dim: int = 0
    max_context: int = 0        # tokens the model serves (max_position_embeddings); 0 = unknown

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0


def _need(cfg: Mapping[str, Any], key: str, where: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        got = "missing" if value is None else f"{value!r} is not a positive integer"
        raise ConfigError([f"{where}: key '{key}' {got}"])
    return value


def estimate_params(cfg: Mapping[str, Any], where: str = "config") -> tuple[int, int]:
    """(total, active-per-token) parameter counts of a Llama/Qwen2-style dense, Mixtral-style MoE
    or DeepSeek-V2/V3-style (MLA + MoE) decoder, from its HF config. Norms and biases included,
    multi-token-prediction layers not."""
    h = _need(cfg, "hidden_size", where)
    layers = _need(cfg, "num_hidden_layers", where)
    heads = _need(cfg, "num_attention_heads", where)
    vocab = _need(cfg, "vocab_size", where)
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2) + h
    if cfg.get("kv_lora_rank"):
        nope, rope = _need(cfg, "qk_nope_head_dim", where), _need(cfg, "qk_rope_head_dim", where)
        v, lora = _need(cfg, "v_head_dim", where), _need(cfg, "kv_lora_rank", where)
        q_lora = cfg.get("q_lora_rank") or 0
        q_out = heads * (nope + rope)
        q = h * q_lora + q_lora + q_lora * q_out if q_lora else h * q_out
        attn = q + h * (lora + rope) + lora + lora * heads * (nope + v) + heads * v * h
    else:
        kv = cfg.get("num_key_value_heads") or heads
        hd = cfg.get("head_dim") or h // heads
        has_bias = cfg.get("attention_bias") or cfg.get("model_type") == "qwen2"
        bias = (heads + 2 * kv) * hd if has_bias else 0
        attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h + bias
    dense_mlp = 3 * h * _need(cfg, "intermediate_size", where)
    if cfg.get("n_routed_experts"):                       # DeepSeek style
        moe_i, n = _need(cfg, "moe_intermediate_size", where), _need(cfg, "n_routed_experts", where)
        shared, k = cfg.get("n_shared_experts") or 0, _need(cfg, "num_experts_per_tok", where)
        dense_layers = min(cfg.get("first_k_dense_replace") or 0, layers)
        expert = 3 * h * moe_i
        moe_total, moe_active = (n + shared) * expert + n * h + n, (k + shared) * expert + n * h + n
        mlp_total = dense_layers * dense_mlp + (layers - dense_layers) * moe_total
        mlp_active = dense_layers * dense_mlp + (layers - dense_layers) * moe_active
    elif cfg.get("num_local_experts"):                    # Mixtral style
        n, k = _need(cfg, "num_local_experts", where), _need(cfg, "num_experts_per_tok", where)
        mlp_total, mlp_active = layers * (n * dense_mlp + n * h), layers * (k * dense_mlp + n * h)
    elif cfg.get("num_experts"):
        raise ConfigError([f"{where}: cannot estimate the parameter count of this MoE layout "
                           "('num_experts'); give it with --params"])
    else:
        mlp_total = mlp_active = layers * dense_mlp
    common = embed + layers * (attn + 2 * h)
    return common + mlp_total, common + mlp_active


def architecture_from_config(cfg: Mapping[str, Any], name: str, params: int | None = None,
                             where: str = "config") -> Architecture:
    """Architecture from a HuggingFace config.json mapping. `params` overrides the estimate.
    Raises ConfigError naming the first missing or bad key."""
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        cfg = cfg["text_config"]                          # multimodal wrapper: the LLM inside
    layers = _need(cfg, "num_hidden_layers", where)
    heads = _need(cfg, "num_attention_heads", where)
    kv_heads = _need(cfg, "num_key_value_heads", where) if "num_key_value_heads" in cfg else heads
    if cfg.get("kv_lora_rank"):
        lora, rope = _need(cfg, "kv_lora_rank", where), _need(cfg, "qk_rope_head_dim", where)
        nope = cfg.get("qk_nope_head_dim") or 0
        qk, v, head_dim = nope + rope, cfg.get("v_head_dim") or nope or rope, lora + rope
    else:
        lora = rope = 0
        head_dim = cfg["head_dim"] if cfg.get("head_dim") else (
            _need(cfg, "hidden_size", where) // heads if "hidden_size" in cfg else 0)
        if not head_dim:
            raise ConfigError([f"{where}: key 'head_dim' missing (and no 'hidden_size' to derive "
                               "it from hidden_size / num_attention_heads)"])
        qk = v = head_dim
    if params is None:
        params, active = estimate_params(cfg, where)
    else:   # MoE: the active share from the layout if it can be estimated, else all of them
        active = params
        if cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts"):
            try:
                active = min(params, estimate_params(cfg, where)[1])
            except ConfigError:
                pass
    return Architecture(name, layers, heads, kv_heads, head_dim, int(params), int(active),
                        lora, rope, qk, v, max_context(cfg))


def max_context(cfg: Mapping[str, Any]) -> int:
    """The context window of a HF config: `max_position_embeddings`, times a YaRN factor the
    window does not include yet (Qwen2.5's 32768 x 4); 0 when the config does not say."""
    window = cfg.get("max_position_embeddings")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        return 0
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, Mapping) and "yarn" in (scaling.get("type"), scaling.get("rope_type")):
        factor, original = scaling.get("factor"), scaling.get("original_max_position_embeddings")
        if isinstance(factor, (int, float)) and factor > 1 and (original is None
                                                                or original >= window):
            return int(window * factor)
    return window


def _unknown_preset(name: str) -> ConfigError:
    return ConfigError([f"unknown model preset '{name}'; presets: {', '.join(MODELS)} "
                        "(or give the path of a HuggingFace config.json)"])


def preset_architecture(name: str, params: int | None = None) -> Architecture:
    """The preset's architecture; `params` overrides its published parameter count."""
    preset = find_model(name)
    if preset is None:
        raise _unknown_preset(name)
    return architecture_from_config(preset.config, preset.name, params or preset.params,
                                    preset.name)


def load_architecture(model: str, params: int | None = None) -> tuple[Architecture, str]:
    """A preset name or the path of a config.json (or a directory holding one)."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError([f"{path}: not a readable JSON config ({e})"]) from e
        if not isinstance(cfg, dict):
            raise ConfigError([f"{path}: expected a JSON object"])
        name = cfg.get("_name_or_path") or path.parent.name or str(path)
        return architecture_from_config(cfg, str(name), params, str(path)), f"{path}"
    preset = find_model(model)
    local = model.endswith(".json") or model.startswith(("/", "./", "../", "~"))
    if preset is None or local:
        if local or "/" in model:
            raise ConfigError([f"--model {model}: no such config.json, nor the HuggingFace id of "
                               f"a preset (presets: {', '.join(MODELS)})"])
        raise _unknown_preset(model)
    return preset_architecture(preset.name, params), f"preset: {preset.source}"
