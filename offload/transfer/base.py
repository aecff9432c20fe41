"""The one transfer interface and the router that picks its implementation from the decided path.

Primitives:
- `TransferPath`: a `BlockStore` whose `put_many` / `get_many` move a batch of pages between memory
  (host-pool pages; GPU memory where the path allows) and where blocks live, returning per-page
  success and never raising; plus `name` and `register_region(buffer)` (memory the path may move
  without a copy: NIXL registration on the dpu path, a no-op elsewhere).
- `choose_path(cfg, decision)` -> "cpu" | "gds" | "dpu": an explicit `offload.transfer.path` wins;
  `auto` follows detection (`offload.hw.detect_and_decide`), run here if no decision is passed.
  On a DPU's Arm cores (decision role "agent") there is no host path: PathUnavailableError.
- `open_path(cfg, decision=None, store=None)`: construct the chosen path. Implementations live in
  their own modules (`PATHS`) and are imported only when chosen, so NIXL / kvikio / torch load only
  where they are used. `store` is the local block store for cpu / gds (default: `DiskStore`).
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, Sequence

from offload.config import OffloadConfig
from offload.errors import PathUnavailableError
from offload.keys import Namespace
from offload.store.base import BlockStore, Buffer, durable, flush

# path name -> (module, class); each class has `open(cfg, decision, store) -> TransferPath`.
PATHS: dict[str, tuple[str, str]] = {
    "cpu": ("offload.transfer.cpu_staging", "CpuStagingPath"),
    "gds": ("offload.transfer.gds", "GdsPath"),
    "dpu": ("offload.agent.client", "AgentStore"),
}


class TransferPath(BlockStore, Protocol):
    name: str

    def register_region(self, buffer: Any) -> None:
        """Memory that pages will live in (e.g. the host KV pool), registered once."""
        ...

    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Buffer]]) -> list[bool]:
        """Write pages (each a list of buffers) under their keys; one flag per page."""
        ...

    def get_many(self, keys: Sequence[bytes], dests: Sequence[Sequence[Buffer]]) -> list[bool]:
        """Read pages into the given buffers; True only if read and verified."""
        ...


class StoreBookkeeping:
    """What a path leaves to the store it moves bytes for: lookups, deletes, namespaces."""

    store: BlockStore

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self.store.exists_many(keys)

    def delete_many(self, keys: Sequence[bytes]) -> int:
        return self.store.delete_many(keys)

    def clear(self, namespace: bytes | None = None) -> int:
        return self.store.clear(namespace)

    def register_namespace(self, ns: Namespace) -> None:
        self.store.register_namespace(ns)

    def flush(self) -> bool:
        """Wait until the store's puts are durable (it may commit them in the background)."""
        return flush(self.store)

    def durable(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether it is stored durably now (`offload.store.base.durable`)."""
        return durable(self.store, keys, [True] * len(keys))


def choose_path(cfg: OffloadConfig, decision: Any = None) -> str:
    """The path to use: the config's explicit choice, else the detection decision's."""
    requested = cfg.transfer.path
    if requested != "auto":
        return requested
    if decision is None:
        from offload.hw import detect_and_decide

        _, decision = detect_and_decide(cfg)   # every directory of the store
    if getattr(decision, "role", "host") == "agent":
        raise PathUnavailableError("this process runs on a BlueField DPU's Arm cores: run "
                                   "`sglang-offload agent` here and inference on the host")
    path = str(decision.path)
    if path not in PATHS:
        raise PathUnavailableError(f"detection chose an unknown path {path!r}")
    return path


def open_path(cfg: OffloadConfig, decision: Any = None, store: BlockStore | None = None
              ) -> TransferPath:
    """Construct the transfer path for this process (control path: raises typed errors)."""
    name = choose_path(cfg, decision)
    module, cls = PATHS[name]
    return getattr(importlib.import_module(module), cls).open(cfg, decision, store)
