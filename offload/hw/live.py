"""Probes of the live process: what a directory tree cannot hold.

Primitives: `Live` (a bundle of small injectable functions) with `Live.default()` for this machine
and `Live.offline()` for a fixture root, where none of them runs and every result they would give
is reported as `not checked`. The functions:

- `nvml() -> NvmlReport`       GPUs through NVML (`nvidia-ml-py`, module `pynvml`); never raises.
- `load_cufile() -> (ok, why)`  whether `libcufile.so.0` loads (kvikio's first GDS condition).
- `nvfs_modules() -> str | None`  `/proc/driver/nvidia-fs/modules` read while `/dev/nvidia-fs0`
                                is held open: nvidia-fs registers the storage drivers when a
                                process opens it and drops them when the last one closes, so
                                the file read cold lists nothing. None: the file is missing.
- `run(argv, timeout) -> CommandResult | None`  run a tool (mlxconfig, pkg-config); None = not
                                installed.
- `uname() -> (release, machine)`
- `connect(address, timeout) -> (ok, why)`  a TCP connection to the offload agent.
- `python(executable, timeout) -> PythonReport`  the Python side of the paths in the interpreter
                                that will run SGLang: it runs `EXE -c PYTHON_PROBE`, which only
                                asks `importlib.util.find_spec` and `importlib.metadata` (nothing is
                                imported, no native code loaded) for kvikio, NIXL, msgspec, redis-py,
                                prometheus-client and torch's CUDA (read off torch/version.py).
                                It is a fact of that interpreter, not of the root, so `offline()`
                                keeps it: fixture roots are judged with it too.

Each native library is loaded only inside these functions, and only if it is present.
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
from dataclasses import dataclass
from typing import Callable, Sequence

NOT_CHECKED = "not checked"
log = logging.getLogger("offload.hw.live")


@dataclass(frozen=True)
class NvmlGpu:
    index: int
    bdf: str
    name: str
    memory_bytes: int | None
    numa_node: int | None
    mig: bool | None


@dataclass(frozen=True)
class NvmlReport:
    """status: `ok` (gpus filled), `unavailable` (why in reason)."""

    status: str
    reason: str
    gpus: tuple[NvmlGpu, ...] = ()
    driver: str | None = None


@dataclass(frozen=True)
class CommandResult:
    rc: int
    stdout: str
    stderr: str = ""


def normalise_bdf(bus_id: str) -> str:
    """`00000000:1B:00.0` (NVML) -> `0000:1b:00.0` (sysfs)."""
    bus_id = bus_id.strip().lower()
    parts = bus_id.split(":")
    if len(parts) == 3:
        domain = parts[0][-4:].rjust(4, "0")
        return f"{domain}:{parts[1]}:{parts[2]}"
    if len(parts) == 2:
        return f"0000:{bus_id}"
    return bus_id


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_query() -> NvmlReport:
    """Query NVML; every failure becomes an `unavailable` report with the reason."""
    try:
        import pynvml  # nvidia-ml-py: pure Python, loads libnvidia-ml.so only in nvmlInit
    except ImportError:
        return NvmlReport("unavailable", "nvidia-ml-py (module pynvml) is not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return NvmlReport("unavailable", f"NVML did not initialise: {e}")
    except OSError as e:  # pragma: no cover - odd loader failures
        return NvmlReport("unavailable", f"NVML did not load: {e}")
    gpus = []
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = _text(pynvml.nvmlDeviceGetName(h))
            bdf = normalise_bdf(_text(pynvml.nvmlDeviceGetPciInfo_v3(h).busId))
            mem = numa = mig = None
            try:
                mem = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
            except pynvml.NVMLError:
                pass
            try:
                numa = int(pynvml.nvmlDeviceGetNumaNodeId(h))
            except (pynvml.NVMLError, AttributeError):
                pass
            try:
                mig = bool(pynvml.nvmlDeviceGetMigMode(h)[0])
            except pynvml.NVMLError:
                pass
            gpus.append(NvmlGpu(i, bdf, name, mem, numa, mig))
    except pynvml.NVMLError as e:
        return NvmlReport("unavailable", f"NVML query failed: {e}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return NvmlReport("ok", f"NVML driver {driver}: {len(gpus)} GPU(s)", tuple(gpus), driver)


def load_cufile() -> tuple[bool, str]:
    """Whether libcufile.so.0 loads (dlopen, as kvikio does). Loads it only if present."""
    import ctypes

    try:
        ctypes.CDLL("libcufile.so.0")
    except OSError as e:
        return False, f"libcufile.so.0 does not load: {e}"
    return True, "libcufile.so.0 loads"


NVFS_MODULES = "/proc/driver/nvidia-fs/modules"


def nvfs_modules() -> str | None:
    """`NVFS_MODULES` with `/dev/nvidia-fs0` held open (as libcufile holds it); None if missing."""
    import os

    fd = None
    try:
        fd = os.open("/dev/nvidia-fs0", os.O_RDONLY)
    except OSError as e:
        log.debug("cannot open /dev/nvidia-fs0 (%s): reading %s as it is", e, NVFS_MODULES)
    try:
        with open(NVFS_MODULES) as f:
            return f.read()
    except OSError:
        return None
    finally:
        if fd is not None:
            os.close(fd)


def run_command(argv: Sequence[str], timeout: float = 10.0) -> CommandResult | None:
    """Run a tool; None when it is not installed. Never raises."""
    if shutil.which(argv[0]) is None:
        log.debug("run %s: not installed", argv[0])
        return None
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("run %s: %s", " ".join(argv), e)
        return CommandResult(-1, "", str(e))
    log.debug("run %s: exit %d", " ".join(argv), p.returncode)
    return CommandResult(p.returncode, p.stdout, p.stderr)


def uname() -> tuple[str, str]:
    import os

    u = os.uname()
    return u.release, u.machine


def split_address(address: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port). Raises ValueError."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def connect(address: str, timeout: float = 2.0) -> tuple[bool, str]:
    """Whether a TCP connection to the agent opens within `timeout`."""
    try:
        host, port = split_address(address)
        with socket.create_connection((host, port), timeout=timeout):
            log.debug("connect %s: accepted", address)
            return True, f"agent {address} accepted a TCP connection"
    except (OSError, ValueError) as e:
        log.debug("connect %s: %s", address, e)
        return False, f"agent {address} is not reachable: {e}"


# Import name -> the distributions that may provide it (first installed one wins).
PYTHON_MODULES: dict[str, tuple[str, ...]] = {
    "kvikio": ("kvikio-cu13", "kvikio-cu12", "kvikio"),
    "nixl": ("nixl",),
    "nixl_cu13": ("nixl-cu13",),
    "nixl_cu12": ("nixl-cu12",),
    "msgspec": ("msgspec",),
    "redis": ("redis",),
    "prometheus_client": ("prometheus-client",),
    "torch": ("torch",),
}

# Run as `EXE -c PYTHON_PROBE MODULES_JSON`; prints one JSON object. No module is imported.
PYTHON_PROBE = r"""
import importlib.metadata as m, importlib.util as u, json, os, re, sys
mods = {}
for name, dists in json.loads(sys.argv[1]).items():
    try:
        spec = u.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    dist = version = None
    for d in dists:
        try:
            version, dist = m.version(d), d
            break
        except m.PackageNotFoundError:
            pass
    mods[name] = {"found": spec is not None, "dist": dist, "version": version}
cuda = None
spec = mods["torch"]["found"] and u.find_spec("torch")
for loc in (spec.submodule_search_locations or []) if spec else []:
    f = os.path.join(loc, "version.py")
    if os.path.isfile(f):
        hit = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*['\"]([^'\"]+)['\"]", open(f).read(), re.M)
        cuda = hit.group(1) if hit else None
        break
print(json.dumps({"executable": sys.executable, "python": sys.version.split()[0],
                  "torch_cuda": cuda, "modules": mods}))
"""


@dataclass(frozen=True)
class PyModule:
    name: str  # import name
    found: bool  # importlib.util.find_spec found it
    dist: str | None  # the installed distribution that provides it
    version: str | None


@dataclass(frozen=True)
class PythonReport:
    """status: `ok` (the interpreter answered), `unavailable` (why in reason)."""

    executable: str
    status: str
    reason: str
    python: str | None = None
    torch_cuda: str | None = None  # torch.version.cuda; None: no torch, or a CPU build
    modules: tuple[PyModule, ...] = ()


def python_query(executable: str, timeout: float = 30.0) -> PythonReport:
    """Ask `executable` what it can import (find_spec + metadata only). Never raises."""
    log.debug("asking %s -c <probe> which of %s it can import", executable, ", ".join(PYTHON_MODULES))
    try:
        p = subprocess.run([executable, "-c", PYTHON_PROBE, json.dumps(PYTHON_MODULES)],
                           capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        return PythonReport(executable, "unavailable", f"{executable} did not run: {e}")
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return PythonReport(executable, "unavailable",
                            f"{executable} -c <probe> exited {p.returncode}: {tail}")
    try:
        data = json.loads(p.stdout.strip().splitlines()[-1])
        mods = tuple(PyModule(name, bool(v["found"]), v["dist"], v["version"])
                     for name, v in data["modules"].items())
    except (ValueError, KeyError, IndexError, TypeError) as e:
        return PythonReport(executable, "unavailable", f"{executable}: unreadable probe output "
                            f"({e}): {p.stdout[-200:]!r}")
    return PythonReport(executable, "ok", f"Python {data['python']}",
                        data["python"], data["torch_cuda"], mods)


@dataclass(frozen=True)
class Live:
    """The injectable live probes; a None member is `not checked`."""

    nvml: Callable[[], NvmlReport] | None = None
    load_cufile: Callable[[], tuple[bool, str]] | None = None
    nvfs_modules: Callable[[], str | None] | None = None
    run: Callable[[Sequence[str], float], CommandResult | None] | None = None
    uname: Callable[[], tuple[str, str]] | None = None
    connect: Callable[[str, float], tuple[bool, str]] | None = None
    python: Callable[[str, float], PythonReport] | None = None

    @classmethod
    def default(cls) -> "Live":
        return cls(nvml=nvml_query, load_cufile=load_cufile, nvfs_modules=nvfs_modules,
                   run=run_command, uname=uname,
                   connect=connect, python=python_query)

    @classmethod
    def offline(cls) -> "Live":
        """A fixture root: no probe of this machine runs; the interpreter is still asked."""
        return cls(python=python_query)
