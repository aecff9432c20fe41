"""The gds path: GPUDirect Storage with kvikio `CuFile`, GPU memory <-> the disk store's slots.

Used only when detection reports GDS really available (never compat-only): `GdsPath.open` refuses
otherwise, and kvikio runs with compat mode OFF so that a file cuFile cannot take fails loudly
instead of silently bouncing through host memory. Every failed transfer is a miss (a get) or not
stored (a put) for exactly the page it carried, never loaded, counted per kind
(`failure_counts()`: `cufile_register`, `gds_read`, `gds_write`); its file then moves, logged
once, to the cpu path (pinned, double-buffered staging through the store's own O_DIRECT I/O),
which serves that file's later pages.

The store must be an `offload.store.base.SlotStore` whose slots are files (`slot_medium`
"file": DiskStore): blocks are written into reserved slots and committed with the checksum
computed here, and read from pinned slots (each with its stored checksum).

Primitives:
- `wsum64(tensor)`: the block checksum computed on the GPU (position-weighted 64-bit word sum;
  the store verifies the same sum on the CPU with `wsum64_numpy` when such a block is read there).
- `GdsPath(store)`: `put_many` / `get_many` on CUDA tensors; host buffers go to the cpu path.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Sequence

from offload.errors import PathUnavailableError
from offload.store.base import (
    BlockStore,
    Buffer,
    Slot,
    SlotStore,
    StoreStats,
    all_false,
    never_raises,
    promote,
)
from offload.transfer.base import FailureCounts, StoreBookkeeping, failures_of, with_failures

if TYPE_CHECKING:
    from offload.config import OffloadConfig
    from offload.hw.decide import Decision

log = logging.getLogger(__name__)
CHECKSUM_KIND = "wsum64"


def wsum64(data: Any) -> int:
    """Checksum of a CUDA uint8 tensor: sum of 64-bit words times odd position weights, mod 2^64."""
    import torch

    flat = data.reshape(-1).view(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    words = flat.view(torch.int64)
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64) * 2 + 1
    s = int((words * weights).sum().item()) & ((1 << 64) - 1)     # int64 wraps: mod 2^64
    return s ^ (flat.numel() - pad)


def wsum64_numpy(buf: Buffer) -> int:
    """The same checksum on the CPU (the store's own `checksum.wsum64`, which verifies GDS blocks)."""
    from offload.store.checksum import wsum64 as cpu_wsum64

    return cpu_wsum64([buf])


def gds_really_available(decision: Decision | None) -> tuple[bool, str]:
    """GDS only when detection chose it with GPU-direct (never a compat-only setup)."""
    if decision is None:
        return False, "no detection decision: run `sglang-offload detect`"
    if decision.path != "gds" or not decision.gpu_direct:
        return False, f"detection chose {decision.path}, not GDS"
    return True, "detection: GDS available (not compat mode)"


class GdsPath(StoreBookkeeping):
    name = "gds"
    store: SlotStore

    def __init__(self, store: SlotStore, fallback: BlockStore | None = None):
        import kvikio
        import kvikio.defaults

        self.kvikio = kvikio
        kvikio.defaults.set("compat_mode", kvikio.CompatMode.OFF)
        self.store = store
        if fallback is None:
            from offload.transfer.cpu_staging import CpuStagingPath

            fallback = CpuStagingPath(store)
        self.fallback = fallback
        self._files: dict[str, Any] = {}
        self._no_gds: set[str] = set()
        self._lock = threading.Lock()
        self.failures = FailureCounts()

    def parts(self) -> Sequence[BlockStore]:
        """The store's slab files, and the path taking what cuFile cannot (`Composite`)."""
        return [self.store, self.fallback]

    @classmethod
    def open(cls, cfg: OffloadConfig, decision: Decision | None = None,
             store: BlockStore | None = None) -> "GdsPath":
        ok, why = gds_really_available(decision)
        if not ok and cfg.transfer.path == "gds":
            raise PathUnavailableError(f"offload.transfer.path gds: {why}")
        if store is None:
            from offload.store.factory import open_disk

            store = open_disk(cfg.store)
        if not isinstance(store, SlotStore) or store.slot_medium != "file":
            raise PathUnavailableError(f"gds: {type(store).__name__} has no slots in files for "
                                       "cuFile (a SlotStore, reserve_slots, of medium 'file')")
        try:
            return cls(store)
        except ImportError as e:
            raise PathUnavailableError(f"gds needs kvikio: install the gds extra for torch's CUDA "
                                       f"from the checkout, `.venv/bin/pip install -e "
                                       f"'.[gds-cu13]'` or `'.[gds-cu12]'` (docs/install.md) "
                                       f"({e})") from None

    def _file(self, path: str) -> tuple[Any | None, bool]:
        """(`path`'s CuFile, or None when cuFile cannot take it; whether it refused it just now:
        the page that met the refusal is a failed transfer, later ones go to CPU staging)."""
        with self._lock:
            if path in self._no_gds:
                return None, False
            f = self._files.get(path)
            if f is not None:
                return f, False
            try:
                f = self.kvikio.CuFile(path, "r+")
            except Exception as e:  # noqa: BLE001 - per-file fallback, logged once
                log.warning("gds: cuFile refused %s (%s); CPU staging for it from now on", path, e)
                self._no_gds.add(path)
                return None, True
            self._files[path] = f
            return f, False

    def _demote(self, path: str, e: BaseException) -> None:
        with self._lock:
            log.warning("gds: I/O on %s failed (%s); CPU staging for it from now on", path, e)
            self._no_gds.add(path)
            f = self._files.pop(path, None)
        if f is not None:
            try:
                f.close()
            except Exception as ce:  # noqa: BLE001 - closing a handle that failed I/O
                log.debug("gds: closing %s: %s", path, ce)

    def register_region(self, buffer: Any) -> None:
        """Nothing to register: cuFile registers GPU buffers per transfer."""

    @never_raises("gds put", all_false)
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Any]]) -> list[bool]:
        ok = [False] * len(keys)
        gpu = [i for i, bs in enumerate(blocks) if len(bs) == 1 and getattr(bs[0], "is_cuda", False)]
        rest = [i for i in range(len(keys)) if i not in set(gpu)]
        sizes = [blocks[i][0].numel() * blocks[i][0].element_size() for i in gpu]
        slots = self.store.reserve_slots([keys[i] for i in gpu], sizes) if gpu else []
        done: list[Slot] = []
        done_idx: list[int] = []
        sums: list[int] = []
        for i, slot in zip(gpu, slots):
            if slot is None:
                ok[i] = self.store.exists_many([keys[i]])[0]
                continue
            f, refused = self._file(slot.path)
            if f is None:
                self.store.abort_slots([slot])
                if refused:      # this page's transfer failed: not stored
                    self.failures.add("cufile_register")
                else:            # a file demoted before: the cpu path writes it
                    rest.append(i)
                continue
            try:
                t = blocks[i][0]
                if f.pwrite(t, slot.length, slot.offset).get() != slot.length:
                    raise OSError("short write")
                sums.append(wsum64(t))
            except Exception as e:  # noqa: BLE001 - this page is not stored
                self._demote(slot.path, e)
                self.store.abort_slots([slot])
                self.failures.add("gds_write")
                continue
            done.append(slot)
            done_idx.append(i)
        for i, flag in zip(done_idx, self.store.commit_slots(done, sums) if done else []):
            ok[i] = flag
        if rest:
            for i, flag in zip(rest, self.fallback.put_many([keys[i] for i in rest],
                                                            [blocks[i] for i in rest])):
                ok[i] = flag
        return ok

    @never_raises("gds promotion", all_false)
    def promote_many(self, keys: Sequence[bytes], blocks: Sequence[Sequence[Any]]) -> list[bool]:
        """A put on a read's path (a tiered store's promotion): host blocks through the CPU
        path's promotion (`offload.store.base.promote`), GPU blocks as `put_many` writes them."""
        if any(getattr(b, "is_cuda", False) for bs in blocks for b in bs):
            return self.put_many(keys, blocks)
        return promote(self.fallback, keys, blocks)

    @never_raises("gds get", all_false)
    def get_many(self, keys: Sequence[bytes], dests: Sequence[Sequence[Any]]) -> list[bool]:
        ok = [False] * len(keys)
        gpu = [i for i, bs in enumerate(dests) if len(bs) == 1 and getattr(bs[0], "is_cuda", False)]
        rest = [i for i in range(len(keys)) if i not in set(gpu)]
        slots = self.store.pin_slots([keys[i] for i in gpu]) if gpu else []
        pinned: list[Slot] = []
        read: list[bool] = []
        for i, slot in zip(gpu, slots):
            if slot is None:
                continue
            pinned.append(slot)
            ok[i] = self._read(slot, dests[i][0], rest, i)
            read.append(ok[i])
        if pinned:
            self.store.unpin_slots(pinned, read)
        if rest:
            for i, flag in zip(rest, self.fallback.get_many([keys[i] for i in rest],
                                                            [dests[i] for i in rest])):
                ok[i] = flag
        return ok

    def _read(self, slot: Slot, t: Any, rest: list[int], i: int) -> bool:
        """One block from its slot into tensor `t`. A failed transfer (cuFile refusing the file
        now, a read failing or short) is a miss for this page and moves the file to CPU
        staging; a file moved before sends the page to `rest` (the cpu path)."""
        if slot.length != t.numel() * t.element_size():
            return False
        f, refused = self._file(slot.path)
        if f is None:
            if refused:
                self.failures.add("cufile_register")
            else:
                rest.append(i)
            return False
        try:
            if f.pread(t, slot.length, slot.offset).get() != slot.length:
                raise OSError("short read")
            good = wsum64(t) == slot.checksum
        except Exception as e:  # noqa: BLE001 - this page is a miss
            self._demote(slot.path, e)
            self.failures.add("gds_read")
            return False
        if not good:
            log.warning("gds: block %s fails its checksum; deleted, a miss", slot.key.hex()[:16])
            self.store.delete_many([slot.key])
            return False
        return True

    def failure_counts(self) -> dict[str, int]:
        """Pages a GDS transfer failed (and the CPU fallback's copies), per kind."""
        return self.failures.snapshot(failures_of(self.fallback))

    def stats(self) -> StoreStats:
        s = self.store.stats()
        s.extra = dict(s.extra, path="gds", gds_files=len(self._files),
                       gds_fallback_files=len(self._no_gds),
                       transfer_failures=self.failure_counts())
        return s

    def tier_stats(self) -> dict[str, StoreStats]:
        return with_failures(self.store.tier_stats(), self.failure_counts())

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
        self.fallback.close()
