"""`DemoSpec`: the shape of the demo model, checked before anything is written.

The defaults (4 layers, hidden 256, 4 query / 2 KV heads of 64, bf16) let two CPU cores prefill an
8K-token prompt in seconds, and make one 64-token page of the page_first host pool 64 KiB (4 KiB
aligned: the store's zero-copy O_DIRECT path).
"""

from __future__ import annotations

from dataclasses import dataclass

from offload.errors import ConfigError

DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class DemoSpec:
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 1024             # tokenizer size target; config.json pads it to a multiple of 64
    context: int = 32768          # max_position_embeddings
    dtype: str = "bfloat16"
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def check(self) -> None:
        """Raise ConfigError naming every bad option, its value and what is allowed."""
        problems = [f"--{name.replace('_', '-')}: {value} must be >= {low}"
                    for name, value, low in (("layers", self.layers, 1), ("hidden", self.hidden, 8),
                                             ("heads", self.heads, 1),
                                             ("kv_heads", self.kv_heads, 1),
                                             ("intermediate", self.intermediate, 1),
                                             ("vocab", self.vocab, 300),
                                             ("context", self.context, 128),
                                             ("seed", self.seed, 0)) if value < low]
        if self.vocab > 65536:
            problems.append(f"--vocab: {self.vocab} must be <= 65536")
        if not problems and self.hidden % self.heads:
            problems.append(f"--hidden: {self.hidden} is not a multiple of --heads {self.heads}")
        elif not problems and self.head_dim % 2:
            problems.append(f"--hidden/--heads: head size {self.head_dim} must be even (RoPE)")
        if not problems and self.heads % self.kv_heads:
            problems.append(f"--kv-heads: {self.kv_heads} does not divide --heads {self.heads}")
        if self.dtype not in DTYPES:
            problems.append(f"--dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if problems:
            raise ConfigError(problems)
