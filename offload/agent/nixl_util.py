"""Shared NIXL plumbing of the DPU path: import on first use, agents, buffer addresses, waits.

Primitives: `import_nixl()` (sets `UCX_MODULES=^ib` unless already set, then imports `nixl`;
raises `PathUnavailableError` when it is not installed), `make_agent(name)` (a thread-safe NIXL
agent with the UCX backend), `region_of(buffer)` -> (address, nbytes) of any buffer-protocol object
or torch CPU tensor, `metadata_name(md)` -> the NIXL agent name a metadata blob carries (read without
loading it), `run_xfer(agent, op, local, remote, peer, deadline, on_pending)` -> bool (posts one
transfer and polls it to completion or deadline; a transfer still running at its deadline is
handed to `on_pending`, else released), `xfer_state(agent, handle)` -> "DONE" / "ERR" / "PROC",
`warn_peer(kind, peer, msg, *args)` (a transfer failure logged at most once per 5 s per kind and
host: a host whose endpoint fails every transfer cannot flood the agent's log).

`UCX_MODULES=^ib`: without InfiniBand hardware UCX's ib module makes the process crash at exit on
these hosts; real RDMA deployments set UCX_MODULES themselves (it is only set when absent).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from types import ModuleType
from typing import Any, Callable, Sequence

from offload.errors import PathUnavailableError

log = logging.getLogger(__name__)

UCX_MODULES_ENV = "UCX_MODULES"          # UCX's own module filter; default here "^ib"
UCX_MODULES_DEFAULT = "^ib"


def import_nixl() -> ModuleType:
    os.environ.setdefault(UCX_MODULES_ENV, UCX_MODULES_DEFAULT)
    try:
        import nixl
    except ImportError as e:
        raise PathUnavailableError(f"the dpu path needs NIXL: install the dpu extra from the "
                                   f"checkout, `.venv/bin/pip install -e '.[dpu]'` "
                                   f"(docs/install.md) ({e})") from None
    logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl


PROGRESS_DELAY_US = 10_000
_construct_lock = threading.Lock()


class _PacedBindings:
    """NIXL's bindings module, except that agent configs get our progress-thread delay."""

    def __init__(self, bindings: ModuleType, delay_us: int):
        self._b = bindings
        self._delay = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._b, name)

    def nixlAgentConfig(self) -> Any:  # noqa: N802 - mirrors the binding's name
        return _PacedConfig(self._b.nixlAgentConfig(), self._delay)

    def nixlAgent(self, name: str, cfg: Any) -> Any:  # noqa: N802
        return self._b.nixlAgent(name, cfg.inner if isinstance(cfg, _PacedConfig) else cfg)


class _PacedConfig:
    def __init__(self, inner: Any, delay_us: int):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "delay", delay_us)

    def __setattr__(self, key: str, value: Any) -> None:
        setattr(self.inner, key, self.delay if key == "pthrDelay" else value)

    def __getattr__(self, key: str) -> Any:
        return getattr(self.inner, key)


def make_agent(name: str, progress_delay_us: int = PROGRESS_DELAY_US) -> Any:
    """A NIXL agent with the UCX backend, safe to use from several threads.

    NIXL's Python wrapper hard-codes a progress-thread delay of 0: its thread then polls UCX
    without pause and burns a CPU core for the life of the process, even on a host whose memory
    is only read and written by its peer. `progress_delay_us` paces that thread instead (it
    still wakes on UCX events; one-sided RDMA / CMA transfers need no target-side progress).
    """
    nixl = import_nixl()
    cfg = nixl.nixl_agent_config(backends=["UCX"],
                                 sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
    api: Any = sys.modules.get("nixl._api")     # untyped: its `nixlBind` is swapped below
    with _construct_lock:
        original = getattr(api, "nixlBind", None)
        if api is not None and original is not None and progress_delay_us:
            api.nixlBind = _PacedBindings(original, progress_delay_us)
        try:
            agent = nixl.nixl_agent(name, cfg)
        finally:
            if api is not None and original is not None:
                api.nixlBind = original
    if "UCX" not in agent.backends:
        raise PathUnavailableError("NIXL has no UCX backend on this host")
    return agent


def region_of(buf: Any) -> tuple[int, int]:
    """(address, nbytes) of a contiguous buffer: buffer protocol or a torch CPU tensor."""
    if hasattr(buf, "data_ptr") and hasattr(buf, "element_size"):   # torch.Tensor
        if not buf.is_contiguous():
            raise ValueError("tensor is not contiguous")
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size())
    import numpy as np

    mv = memoryview(buf)
    if not mv.contiguous:
        raise ValueError("buffer is not contiguous")
    if mv.nbytes == 0:
        return 0, 0
    arr = np.frombuffer(mv.cast("B"), dtype=np.uint8)
    return int(arr.ctypes.data), int(mv.nbytes)


_MD_PREFIX = b"nixlSerDes|Agent"


def metadata_name(md: bytes) -> str | None:
    """The agent name in NIXL metadata (`nixlSerDes|Agent`, u64 LE length, name), or None."""
    if not md.startswith(_MD_PREFIX) or len(md) < len(_MD_PREFIX) + 8:
        return None
    start = len(_MD_PREFIX) + 8
    n = int.from_bytes(md[len(_MD_PREFIX):start], "little")
    if n == 0 or n > 1024 or len(md) < start + n:
        return None
    try:
        return md[start:start + n].decode()
    except UnicodeDecodeError:
        return None


LOG_EVERY_S = 5.0            # a failing peer's transfers are logged at most this often per kind
_LOG_KEEP = 4096             # (kind, host) entries remembered
_logged: "OrderedDict[tuple[str, str], tuple[float, int]]" = OrderedDict()
_log_lock = threading.Lock()


def warn_peer(kind: str, peer: str, msg: str, *args: object, level: int = logging.WARNING
              ) -> None:
    """Log a transfer failure at most once per LOG_EVERY_S per kind and host (the peer's name up
    to its first '/': a host's, `add_peer`), with the count of the others: a host whose endpoint
    fails every transfer must not flood the agent's log."""
    key, now = (kind, peer.split("/", 1)[0]), time.monotonic()
    with _log_lock:
        last, skipped = _logged.pop(key, (-LOG_EVERY_S, 0))
        if now - last < LOG_EVERY_S:
            _logged[key] = (last, skipped + 1)
            return
        _logged[key] = (now, 0)
        while len(_logged) > _LOG_KEEP:
            _logged.popitem(last=False)
    log.log(level, msg + (f" (and {skipped} more like it)" if skipped else ""), *args)


def run_xfer(agent: Any, op: str, local: Sequence[tuple[int, int]],
             remote: Sequence[tuple[int, int]], peer: str, deadline: float,
             on_pending: Callable[[Any], None] | None = None) -> bool:
    """One NIXL transfer (op "READ": remote -> local, "WRITE": local -> remote), waited on.

    Returns True when it completed before `deadline` (time.monotonic()); never raises. A transfer
    still running at its deadline may yet land: with `on_pending` its handle goes there (the caller
    holds the memory it touches until NIXL says it is final, `offload.agent.quarantine`), else it
    is released (NIXL tries to cancel it).
    """
    handle = None
    try:
        handle = start_xfer(agent, op, local, remote, peer)
    except Exception as e:  # noqa: BLE001 - the data path reports failure, never raises
        warn_peer("post", peer, "nixl %s with %s failed: %s", op, peer, e)
        return False
    return wait_xfer(agent, handle, deadline, on_pending, peer)


def start_xfer(agent: Any, op: str, local: Sequence[tuple[int, int]],
               remote: Sequence[tuple[int, int]], peer: str) -> Any:
    """Post a transfer; returns its handle (raises on a bad descriptor or unknown peer)."""
    ldescs = agent.get_xfer_descs([(a, n, 0) for a, n in local], "DRAM")
    rdescs = agent.get_xfer_descs([(a, n, 0) for a, n in remote], "DRAM")
    handle = agent.initialize_xfer(op, ldescs, rdescs, peer)
    state = agent.transfer(handle)
    if state == "ERR":
        release(agent, handle)
        raise RuntimeError(f"posting the {op} failed")
    return handle


def xfer_state(agent: Any, handle: Any) -> str:
    """"DONE", "ERR" (final) or "PROC" (still running); a failed state check is "ERR"."""
    try:
        state = agent.check_xfer_state(handle)
    except Exception as e:  # noqa: BLE001
        log.warning("nixl transfer state check failed: %s", e)
        return "ERR"
    return state if state in ("DONE", "ERR") else "PROC"


def wait_xfer(agent: Any, handle: Any, deadline: float,
              on_pending: Callable[[Any], None] | None = None, peer: str = "") -> bool:
    """Poll a posted transfer until done, error or deadline; releases the handle, except one
    still running at the deadline when `on_pending` takes it."""
    spins = 0
    while True:
        state = xfer_state(agent, handle)
        if state == "DONE":
            release(agent, handle)
            return True
        if state == "ERR":
            warn_peer("failed", peer, "nixl transfer with %s failed", peer)
            release(agent, handle)
            return False
        if time.monotonic() > deadline:
            warn_peer("late", peer, "nixl transfer with %s did not finish before its deadline; "
                  "aborting it", peer)
            if on_pending is not None:
                on_pending(handle)
            else:
                release(agent, handle)
            return False
        spins += 1
        if spins > 64:
            time.sleep(0.0002)


def release(agent: Any, handle: Any) -> None:
    try:
        agent.release_xfer_handle(handle)
    except Exception as e:  # noqa: BLE001 - aborting an unfinished transfer may raise
        log.debug("releasing a nixl transfer handle: %s", e)
