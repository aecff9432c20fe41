"""Probe: do a request's `cache_salt` / `extra_key` reach the page hashes that name L3 blocks?

Run by tests/distro/run_probes.py (for test_cache_salt.py) in a subprocess against the installed SGLang
and against
the patched wheel's install. Uses only SGLang's own code:
  write path  the default (Rust) radix tree: insert a request's tokens under its RadixKey, then
              read the node's storage hash values (the `hash_value` a HiCache backup hands to the
              backend as page keys; UnifiedRadixCache.write_backup_storage -> write_storage)
  read path   get_storage_hash_str(RadixKey(...), None) -- what HybridCacheController.
              _storage_hit_query and UnifiedCacheLinker compute for a prefetch from the root
  decode path DecodeKVCacheOffloadManager._compute_prefix_hash's seed, storage_namespace_seed
`probe()` returns sglang_file and, per namespace label, the write / read / decode key lists.
"""

from __future__ import annotations

import json
from array import array

PAGE = 4
TOKENS = array("q", range(1000, 1016))  # 4 pages, identical for every tenant

# label -> (extra_key, cache_salt)
NAMESPACES = {
    "none": (None, None),
    "empty_salt": (None, ""),
    "salt_a": (None, "tenant-a"),
    "salt_b": (None, "tenant-b"),
    "lora_x": ("lora-x", None),
    "lora_x_salt_a": ("lora-x", "tenant-a"),
    "split_1": ("a", "bc"),
    "split_2": ("ab", "c"),
}


def write_keys(extra_key, cache_salt) -> list[str]:
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.rust_tree_core.adapter import RustUnifiedTreeCore
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    core = RustUnifiedTreeCore(
        CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None,
            page_size=PAGE, tree_components=(ComponentType.FULL,),
        )
    )
    core.set_hicache_enabled()
    key = RadixKey(array("q", TOKENS), extra_key=extra_key, cache_salt=cache_salt)
    step = core.begin_insert(InsertParams(key=key, value=torch.arange(len(TOKENS))))
    while step.result is None:
        step = core.resume_insert()
    core.end_insert()
    node = core.match_prefix(MatchPrefixParams(key=key)).last_device_node
    core.backfill_missing_hash_values()
    return list(core.get_hash_values(node))


def read_keys(extra_key, cache_salt) -> list[str]:
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    key = RadixKey(array("q", TOKENS), extra_key=extra_key, cache_salt=cache_salt)
    return list(get_storage_hash_str(key, None, page_size=PAGE))


def decode_keys(extra_key, cache_salt) -> list[str]:
    from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed

    # The decode manager passes req.extra_key / req.cache_salt; Req stores `cache_salt or None`.
    last = storage_namespace_seed(extra_key, cache_salt or None)
    out = []
    for start in range(0, len(TOKENS), PAGE):
        last = get_hash_str(list(TOKENS[start : start + PAGE]), last)
        out.append(last)
    return out


def probe() -> dict:
    import sglang

    result = {"sglang_file": sglang.__file__, "namespaces": {}}
    for label, (extra_key, salt) in NAMESPACES.items():
        result["namespaces"][label] = {
            "write": write_keys(extra_key, salt),
            "read": read_keys(extra_key, salt),
            "decode": decode_keys(extra_key, salt),
        }
    return result


if __name__ == "__main__":
    print("PROBE " + json.dumps(probe()))
