"""The demo model's families: `FAMILIES`, name -> the writer and one line saying what it is.

`sglang-offload demo-model --family NAME` and the tests that serve each family end to end
(tests/e2e/test_families_serve.py) both write through this table: one code path per family.
Every family has RANDOM weights and the same locally made tokenizer (`offload.demo.write_demo`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from offload.demo.checkpoint import write_demo
from offload.demo.mla import write_mla_demo
from offload.demo.spec import DemoSpec
from offload.demo.swa import write_swa_demo


class Writer(Protocol):
    def __call__(self, directory: str | Path, spec: DemoSpec, overwrite: bool = False
                 ) -> list[Path]: ...


@dataclass(frozen=True)
class Family:
    write: Writer
    about: str                    # one line for --help and the docs: the architecture and its pools


FAMILIES: dict[str, Family] = {
    "llama": Family(write_demo, "Llama, grouped-query attention (SGLang's MHA KV pool)"),
    "mla": Family(write_mla_demo, "DeepSeek-V2 multi-head latent attention (the MLA KV and host "
                                  "pools; --kv-heads is ignored)"),
    "swa": Family(write_swa_demo, "Mellum, sliding-window layers alternating with full attention "
                                  "(the hybrid SWA pools)"),
}
