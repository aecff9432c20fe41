"""Patch 0001: `--hicache-storage-backend offload` -> offload.hicache.OffloadStorage.

The same probe (tests/distro/probe_offload_backend.py) runs against the unpatched upstream
SGLang (the pinned wheel unpacked as is), where every part must be missing, and against the
patched wheel, where SGLang's own argument parser accepts the name, StorageBackendFactory builds
our class like a `dynamic` backend (`cls(storage_config, kwargs)`), and
HiCacheController.attach_storage_backend gives it the interface_v1 page functions.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_unpatched_sglang_has_no_offload_backend_name(upstream_probes, upstream_site):
    result = upstream_probes["offload_backend"]
    assert result["sglang_file"].startswith(str(upstream_site))
    assert result["cli_accepts"] is False
    assert result["registry"] is None
    assert "Unknown storage backend 'offload'" in result["created"]["error"]
    assert str(result["zero_copy"]).startswith("error: Unknown storage backend")


def test_patched_sglang_offers_the_offload_backend(patched_probes, patched_site):
    result = patched_probes["offload_backend"]
    assert result["sglang_file"].startswith(str(patched_site))
    assert result["cli_accepts"] is True
    assert result["registry"] == {"module_path": "offload.hicache", "class_name": "OffloadStorage"}
    created = result["created"]
    assert created["is_stand_in"] and created["config_passed"]
    assert created["second_arg"] == {}  # as _create_dynamic_backend passes its kwargs
    assert result["zero_copy"] is True
    # Once offload/hicache/backend.py exists, the real class must pass SGLang's own loader check.
    assert result["real_class"] in (None, "ok"), result["real_class"]

