"""The CPU stand-ins for what needs a GPU: kvikio's `CuFile` (cuFile / GPUDirect Storage), a CUDA
tensor, and the GPU stager's device calls, each able to fail on demand.

- `Faults`: what to break. `refuse(path)` -> True makes `CuFile(path)` raise (cuFile refusing the
  file's registration); `reads` / `writes`: {call number (0-based, per kind): "short" | "error"};
  `copies`: {copy call number: "error"}; `events`: {event number: "error"} (an asynchronous copy
  failure, raised when the event is synchronized); `yield_copies`: give up the GIL before each
  copy (two threads then interleave inside a batch).
- `fake_kvikio(monkeypatch, faults)`: installs a `kvikio` module whose `CuFile` does `pwrite` /
  `pread` of a CPU tensor's bytes with os.pwrite / os.pread.
- `OnGpu(tensor)`: a CPU uint8 tensor the paths take for a CUDA one (`is_cuda` True).
- `CpuOps(faults)`: `offload.transfer.cpu_staging.DeviceOps` on the CPU (plain tensors for pinned
  memory, synchronous copies, events that raise as `faults.events` says).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest


@dataclass
class Faults:
    refuse: Callable[[str], bool] = lambda path: False
    reads: dict[int, str] = field(default_factory=dict)
    writes: dict[int, str] = field(default_factory=dict)
    copies: dict[int, str] = field(default_factory=dict)
    events: dict[int, str] = field(default_factory=dict)
    yield_copies: bool = False
    calls: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next(self, kind: str) -> int:
        with self.lock:
            n = self.calls.get(kind, 0)
            self.calls[kind] = n + 1
            return n


class _Future:
    def __init__(self, n: int):
        self.n = n

    def get(self) -> int:
        return self.n


def fake_kvikio(monkeypatch: pytest.MonkeyPatch, faults: Faults | None = None) -> Faults:
    """Install the stand-in `kvikio` (with `faults`, a fresh one by default); returns the faults."""
    f = faults or Faults()

    class CuFile:
        def __init__(self, path: str, mode: str):
            if f.refuse(path):
                raise RuntimeError(f"cuFileHandleRegister failed for {path}")
            self.fd = os.open(path, os.O_RDWR)

        def pwrite(self, t: Any, n: int, off: int) -> _Future:
            fault = f.writes.get(f.next("write"))
            if fault == "error":
                raise RuntimeError("cuFileWrite failed")
            data = t.tensor.numpy().tobytes()[:n]
            return _Future(os.pwrite(self.fd, data[:n // 2] if fault == "short" else data, off))

        def pread(self, t: Any, n: int, off: int) -> _Future:
            fault = f.reads.get(f.next("read"))
            if fault == "error":
                raise RuntimeError("cuFileRead failed")
            data = os.pread(self.fd, n // 2 if fault == "short" else n, off)
            t.tensor.view(-1).numpy()[:len(data)] = np.frombuffer(data, np.uint8)
            return _Future(len(data))

        def close(self) -> None:
            os.close(self.fd)

    fake = types.ModuleType("kvikio")
    fake.CuFile = CuFile                                   # type: ignore[attr-defined]
    fake.CompatMode = types.SimpleNamespace(OFF="off")     # type: ignore[attr-defined]
    fake.defaults = types.SimpleNamespace(set=lambda *a: None)   # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvikio", fake)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", fake.defaults)
    return f


class OnGpu:
    """A CPU uint8 tensor that the paths take for a CUDA one."""
    is_cuda = True

    def __init__(self, tensor: Any):
        self.tensor = tensor

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tensor, name)


class _Event:
    def __init__(self, error: str | None):
        self.error = error

    def synchronize(self) -> None:
        if self.error:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


class CpuOps:
    """The GPU stager's device calls on the CPU, failing as `faults` says."""

    def __init__(self, faults: Faults | None = None):
        import torch

        self.torch = torch
        self.faults = faults or Faults()

    def pinned(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8)

    def stream(self) -> Any:
        return object()

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def event(self, stream: Any) -> _Event:
        return _Event(self.faults.events.get(self.faults.next("event")))

    def copy(self, dst: Any, src: Any) -> None:
        if self.faults.copies.get(self.faults.next("copy")) == "error":
            raise RuntimeError("CUDA error: copy failed")
        if self.faults.yield_copies:
            time.sleep(0)          # let another thread's batch run in between
        dst.copy_(src)


def small_chunks(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """The GPU stager's buffers `nbytes` each (so a batch takes several groups)."""
    from offload.transfer import cpu_staging

    monkeypatch.setattr(cpu_staging._GpuStager, "CHUNK", nbytes)
