"""sglang-offload: a verified NVMe / DPU / Redis KV-cache tier below SGLang's HiCache.

Importing this package loads no native library (no CUDA, cuFile, NIXL, Redis client): every heavy
dependency is imported where it is first used.
"""

__version__ = "0.1.0"
