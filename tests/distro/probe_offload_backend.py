"""Probe: does the SGLang on sys.path offer `--hicache-storage-backend offload`?

Run by tests/distro/run_probes.py (for test_offload_backend_patch.py) in a subprocess, once
against the installed (unpatched) SGLang and once with PYTHONPATH pointing at the patched wheel's
install. `probe()` returns:
  sglang_file   where `sglang` was imported from (which tree was probed)
  cli_accepts   whether SGLang's own argument parser accepts the choice
  registry      the StorageBackendFactory entry for "offload" (module_path, class_name) or null
  created       how create_backend("offload", ...) built the backend: class and constructor args
  zero_copy     whether HiCacheController.attach_storage_backend picked the interface_v1 page
                functions (batch_get_v1 / batch_set_v1) for it
  real_class    null until offload/hicache/backend.py exists; then "ok" if SGLang's loader accepts the
                real offload.hicache.OffloadStorage (a HiCacheStorage subclass), else why not
`offload.hicache` is replaced by a recording stand-in, so the probe tests SGLang's wiring and
not our backend (which has its own tests).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import threading
import types


def _stand_in_module():
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    class OffloadStorage(HiCacheStorage):
        """Records how SGLang constructs it; stores nothing."""

        def __init__(self, storage_config, extra):
            self.args = (storage_config, extra)

        def register_mem_pool_host(self, mem_pool_host):
            self.host = mem_pool_host

        def get(self, key, target_location=None, target_sizes=None):
            return None

        def batch_get(self, keys, target_locations=None, target_sizes=None):
            return [None] * len(keys)

        def set(self, key, value=None, target_location=None, target_sizes=None):
            return False

        def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
            return False

        def exists(self, key):
            return False

    module = types.ModuleType("offload.hicache")
    module.OffloadStorage = OffloadStorage
    return module


def _storage_config(extra: dict):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="probe-model", extra_config=extra,
    )


def probe_cli() -> bool:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = parser.parse_args(["--model-path", "m", "--hicache-storage-backend", "offload"])
    except SystemExit:
        return False
    return args.hicache_storage_backend == "offload"


def probe_factory(module) -> tuple[dict | None, dict | None]:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    entry = StorageBackendFactory._registry.get("offload")
    registry = None if entry is None else {k: entry[k] for k in ("module_path", "class_name")}
    config = _storage_config({"offload": {"probe": True}})
    try:
        backend = StorageBackendFactory.create_backend("offload", config, "host-pool")
    except ValueError as exc:
        return registry, {"error": str(exc)}
    return registry, {
        "class": f"{type(backend).__module__}.{type(backend).__qualname__}",
        "is_stand_in": isinstance(backend, module.OffloadStorage),
        "config_passed": backend.args[0] is config,
        "second_arg": backend.args[1],
    }


def probe_attach() -> bool | str:
    """Run the real attach_storage_backend with the process-wide parts (threads, groups) idle."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.runtime_context import get_parallel

    class Controller(HiCacheController):
        def _generate_storage_config(self, model_name=None, storage_backend_extra_config=None):
            return _storage_config(storage_backend_extra_config or {})

        def _create_sync_groups(self):
            return []

        def _start_storage_threads(self):
            pass

        def _stop_storage_threads(self):
            pass

    controller = object.__new__(Controller)
    controller.enable_storage = False
    controller.storage_stop_event = threading.Event()
    controller.host_memory_mode = "cache"
    controller.page_size = 16
    controller.mem_pool_host = types.SimpleNamespace(size=1024, logical_size=1024)
    controller.storage_host_pool = controller.mem_pool_host
    controller.prefetch_hits_sync_groups = []
    controller.prefetch_completion_sync_groups = []
    try:
        with get_parallel().override(attn_dcp_size=1):
            controller.attach_storage_backend("offload", 256, "probe-model", {})
    except ValueError as exc:
        return f"error: {exc}"
    return controller.page_get_func.__func__ is HiCacheController._page_get_zero_copy and (
        controller.page_set_func.__func__ is HiCacheController._page_set_zero_copy
    )


def probe_real_class() -> str | None:
    """None while offload/hicache/backend.py does not exist; else "ok" or why SGLang would refuse it."""
    import importlib.util

    if importlib.util.find_spec("offload.hicache") is None:
        return None
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    try:
        StorageBackendFactory._load_backend_class("offload.hicache", "OffloadStorage", "offload")
    except Exception as exc:  # report, the test prints it
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def probe() -> dict:
    import sglang

    import offload

    real_class = probe_real_class()
    module = _stand_in_module()
    sys.modules["offload.hicache"] = module
    offload.hicache = module
    registry, created = probe_factory(module)
    return {
        "sglang_file": sglang.__file__,
        "cli_accepts": probe_cli(),
        "registry": registry,
        "created": created,
        "zero_copy": probe_attach(),
        "real_class": real_class,
    }


if __name__ == "__main__":
    print("PROBE " + json.dumps(probe()))
