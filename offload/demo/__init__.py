"""A model a CPU box can serve without a network: `sglang-offload demo-model DIR`.

`write_demo(DIR, DemoSpec)` writes a small Llama-architecture checkpoint with RANDOM weights
(config.json, generation_config.json, model.safetensors) and a byte-level BPE tokenizer trained
here on a built-in word list (tokenizer.json, tokenizer_config.json). SGLang and transformers load
it like any HuggingFace checkpoint. The text it generates is gibberish; the KV path (prefill, the
radix cache, HiCache's host pool, the offload tier) is the real one. Same spec, same bytes.
`spec`: the sizes and their checks; `tokenizer`: the tokenizer; `checkpoint`: the files.
Other families on the same files (`FAMILIES`, `--family`): `mla` (DeepSeek-V2 latent attention)
and `swa` (Mellum, hybrid sliding-window).
"""

from offload.demo.checkpoint import write_demo
from offload.demo.families import FAMILIES, Family
from offload.demo.spec import DemoSpec

__all__ = ["FAMILIES", "DemoSpec", "Family", "write_demo"]
