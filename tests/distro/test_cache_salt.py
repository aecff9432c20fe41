"""Tenant isolation in the L3 keys: does `cache_salt` / `extra_key` reach SGLang's page hashes?

Finding (docs/distro.md): in the pinned SGLang 0.5.23 it does -- upstream seeds every new storage
hash chain with `storage_namespace_seed(extra_key, cache_salt)` (sglang/srt/mem_cache/utils.py,
from sgl-project/sglang PR #38577, which took in #37058 for issue #26747), so patches/ carries no
salt patch. These tests keep that true: the same probe body (tests/distro/probe_cache_salt.py) runs
against the unpatched upstream wheel and against the patched wheel, and both must show
  - two salts (or two LoRA extra_keys) -> disjoint page keys, on the write path (the default Rust
    radix tree's node hashes) and on the read path (get_storage_hash_str);
  - the same salt -> the same keys on both paths (a tenant still hits its own blocks);
  - an L3 tier holding tenant A's pages gives tenant B zero leading hits.
If a future pin drops the seeding, these fail and a patch is needed.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

ISOLATED = [  # pairs of namespaces that must share no page key
    ("salt_a", "salt_b"),
    ("none", "salt_a"),
    ("none", "lora_x"),
    ("lora_x", "lora_x_salt_a"),
    ("salt_a", "lora_x_salt_a"),
    ("split_1", "split_2"),  # ("a", "bc") must not alias ("ab", "c")
]


def leading_hits(stored: set[str], keys: list[str]) -> int:
    """What HiCache's batch_exists returns: how many leading pages the tier holds."""
    hits = 0
    for key in keys:
        if key not in stored:
            break
        hits += 1
    return hits


def check_isolation(result: dict) -> None:
    spaces = result["namespaces"]
    for label, keys in spaces.items():
        assert len(keys["write"]) == 4, label
        # Same namespace -> same keys whichever path computes them.
        assert keys["write"] == keys["read"] == keys["decode"], label
    for a, b in ISOLATED:
        assert not set(spaces[a]["write"]) & set(spaces[b]["write"]), (a, b)
    # "" is no salt (RadixKey and Req store `cache_salt or None`): the default namespace.
    assert spaces["empty_salt"]["write"] == spaces["none"]["write"]
    tier = set(spaces["salt_a"]["write"])  # tenant A's prefix was backed up to a shared tier
    assert leading_hits(tier, spaces["salt_a"]["read"]) == 4
    assert leading_hits(tier, spaces["salt_b"]["read"]) == 0
    assert leading_hits(tier, spaces["none"]["read"]) == 0


@pytest.fixture(scope="module")
def installed(upstream_probes) -> dict:
    return upstream_probes["cache_salt"]


def test_pinned_sglang_namespaces_storage_keys(installed, upstream_site):
    assert installed["sglang_file"].startswith(str(upstream_site))
    check_isolation(installed)


def test_patched_wheel_keeps_the_same_isolated_keys(patched_probes, patched_site, installed):
    patched = patched_probes["cache_salt"]
    assert patched["sglang_file"].startswith(str(patched_site))
    check_isolation(patched)
    assert patched["namespaces"] == installed["namespaces"]  # our patches leave hashing alone


def test_the_check_catches_a_token_only_key_scheme(installed):
    """The assertions above would fail on the leak reported in #26747 (keys from tokens alone)."""
    leaky = {"sglang_file": "", "namespaces": {
        label: {path: installed["namespaces"]["none"]["write"] for path in ("write", "read", "decode")}
        for label in installed["namespaces"]
    }}
    with pytest.raises(AssertionError):
        check_isolation(leaky)
