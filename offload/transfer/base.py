"""The one transfer interface and the router that picks its implementation from the decided path.

Primitives:
- `TransferPath`: a `BlockStore` whose `put_many` / `get_many` move a batch of pages between memory
  (host-pool pages; GPU memory where the path allows) and where blocks live, returning per-page
  success and never raising; plus `name` and `register_region(buffer)` (memory the path may move
  without a copy: NIXL registration on the dpu path, a no-op elsewhere).
- `choose_path(cfg, decision)` -> "cpu" | "gds" | "dpu": an explicit `offload.transfer.path` wins;
  `auto` follows detection (`offload.hw.detect_and_decide`), run here if no decision is passed.
  On a DPU's Arm cores (decision role "agent") there is no host path: PathUnavailableError.
- `FailureCounts`: the pages each kind of failed GPU-side transfer cost (`FAILURE_KINDS`), each
  page reported to SGLang as a miss (a get) or not stored (a put), never as loaded; a path shows
  them in its stats' `extra["transfer_failures"]` (`with_failures`), which the metrics watcher
  turns into `sglang_offload_transfer_failures_total{path, kind}`.
- `open_path(cfg, decision=None, store=None)`: construct the chosen path. Implementations live in
  their own modules (`PATHS`) and are imported only when chosen, so NIXL / kvikio / torch load only
  where they are used. `store` is the local block store for cpu / gds (default:
  `offload.store.factory.open_disk(cfg.store)`: a `DiskStore`, or a `SpreadStore` over
  several drives).
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, runtime_checkable

from offload.config import OffloadConfig
from offload.errors import PathUnavailableError
from offload.keys import Namespace
from offload.store.base import BlockStore, Buffer, StoreStats, durable, flush

if TYPE_CHECKING:
    from offload.hw.decide import Decision

# path name -> (module, class); each class is an `OpensPath`.
PATHS: dict[str, tuple[str, str]] = {
    "cpu": ("offload.transfer.cpu_staging", "CpuStagingPath"),
    "gds": ("offload.transfer.gds", "GdsPath"),
    "dpu": ("offload.agent.client", "AgentStore"),
}


# kind -> (the path whose transfer it is, what failed); each page it cost is a miss / not stored
FAILURE_KINDS: dict[str, tuple[str, str]] = {
    "cufile_register": ("gds", "cuFile refused a slab file (CuFile open / handle registration)"),
    "gds_read": ("gds", "a cuFile read failed or came back short"),
    "gds_write": ("gds", "a cuFile write failed or came back short"),
    "copy_to_device": ("cpu", "a host-to-GPU copy out of the pinned staging buffer failed"),
    "copy_to_host": ("cpu", "a GPU-to-host copy into the pinned staging buffer failed"),
}
FAILURES_KEY = "transfer_failures"


class FailureCounts:
    """Thread-safe per-kind page counts of failed GPU-side transfers (`FAILURE_KINDS`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pages: dict[str, int] = {}

    def add(self, kind: str, pages: int = 1) -> None:
        if pages > 0:
            with self._lock:
                self._pages[kind] = self._pages.get(kind, 0) + pages

    def snapshot(self, *more: Mapping[str, int]) -> dict[str, int]:
        """These counts, plus others' (a fallback path's)."""
        with self._lock:
            out = dict(self._pages)
        for m in more:
            for k, n in m.items():
                out[k] = out.get(k, 0) + n
        return out


@runtime_checkable
class CountsFailures(Protocol):
    """A path that counts its failed GPU-side transfers."""

    def failure_counts(self) -> dict[str, int]:
        ...


def failures_of(path: object) -> dict[str, int]:
    """A path's failure counts, or none (a store that moves no GPU memory)."""
    return path.failure_counts() if isinstance(path, CountsFailures) else {}


def with_failures(tiers: dict[str, StoreStats], failures: Mapping[str, int],
                  tier: str = "local") -> dict[str, StoreStats]:
    """`tiers` with `failures` in the extra of `tier` (a copy of its stats)."""
    s = tiers.get(tier)
    if s is None or not failures:
        return tiers
    out = dict(tiers)
    out[tier] = dataclasses.replace(s, extra={**s.extra, FAILURES_KEY: dict(failures)})
    return out


@runtime_checkable
class TransferPath(BlockStore, Protocol):
    """A store that moves pages between memory and where blocks live; `name` is its key in
    `PATHS` (the `path` label of the metrics)."""

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

    def parts(self) -> Sequence[BlockStore]:
        """The block store this path moves bytes for (`offload.store.base.Composite`)."""
        return [self.store]

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


class OpensPath(Protocol):
    """What `PATHS` names: a class whose `open` builds its path for this process (control path:
    typed errors). `store` is the local block store for cpu / gds (default: `open_disk`)."""

    def open(self, cfg: OffloadConfig, decision: Decision | None = None,
             store: BlockStore | None = None) -> TransferPath:
        ...


def choose_path(cfg: OffloadConfig, decision: Decision | None = None) -> str:
    """The path to use: the config's explicit choice, else the detection decision's."""
    requested = cfg.transfer.path
    if requested != "auto":
        return requested
    if decision is None:
        from offload.hw import detect_and_decide

        _, decision = detect_and_decide(cfg)   # every directory of the store
    if decision.role == "agent":
        raise PathUnavailableError("this process runs on a BlueField DPU's Arm cores: run "
                                   "`sglang-offload agent` here and inference on the host")
    path = str(decision.path)
    if path not in PATHS:
        raise PathUnavailableError(f"detection chose an unknown path {path!r}")
    return path


def open_path(cfg: OffloadConfig, decision: Decision | None = None,
              store: BlockStore | None = None) -> TransferPath:
    """Construct the transfer path for this process (control path: raises typed errors)."""
    name = choose_path(cfg, decision)
    module, cls = PATHS[name]
    opener: OpensPath = getattr(importlib.import_module(module), cls)
    return opener.open(cfg, decision, store)
