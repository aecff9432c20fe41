"""What SGLang and our launcher agree on about the backend, in one place (imports no SGLang).

- `BACKEND_NAME`, `MODULE_PATH`, `CLASS_NAME`: how SGLang's `dynamic` storage backend finds
  `OffloadStorage` (`--hicache-storage-backend-extra-config` keys `backend_name`, `module_path`,
  `class_name`; patches/0001 registers the same pair under the name `offload`).
- `BACKEND_EXTRA`: the extra-config entries `launch` composes (with `interface_v1`: SGLang's
  zero-copy `batch_set_v1` / `batch_get_v1`).
- `EXTRA_KEYS`: the extra-config keys the backend reads; `SGLANG_KEYS`: keys SGLang itself reads
  from (or adds to) the same dictionary, which the backend ignores and `launch` passes through.
"""

from __future__ import annotations

from typing import Any

BACKEND_NAME = "offload"
MODULE_PATH = "offload.hicache"
CLASS_NAME = "OffloadStorage"
BACKEND_EXTRA: dict[str, Any] = {"backend_name": BACKEND_NAME, "module_path": MODULE_PATH,
                                 "class_name": CLASS_NAME, "interface_v1": 1}
EXTRA_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "offload", "config_file")
SGLANG_KEYS = ("allocator", "file_storage_path", "tp_lcm_size", "prefetch_threshold",
               "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
               "hicache_storage_pass_prefix_keys")
