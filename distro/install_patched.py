"""Install the patched SGLang wheel into the running interpreter, unless it already holds it.

    .venv/bin/python distro/install_patched.py          # what scripts/install.sh runs
    .venv/bin/python distro/install_patched.py --check  # exit 1 if the installed SGLang is stale

`wanted()` is what distro/build_wheel.py would build now: the version `<pin>+offload.N` and the
OFFLOAD_PATCHES record (sha256 + name of every patch in patches/series). `installed()` reads the
same two from the interpreter's `sglang` distribution. Equal: nothing to do (no build, no pip). Else
the wheel is built into dist/ and installed with `pip install --no-deps --force-reinstall`: SGLang's
dependencies are the caller's choice (distro/sglang-cpu-*.txt on a CPU box, the full set on a GPU
host). Errors are BuildError from build_wheel.py; pip's own output is passed through on failure.
Like build_wheel.py this is a script loaded by path (`distro` is also a PyPI package's name).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent


def _build_wheel() -> ModuleType:
    name = "_sglang_offload_build_wheel"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "build_wheel.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def wanted(bw: ModuleType) -> tuple[str, str]:
    """(version, OFFLOAD_PATCHES text) of the wheel build_wheel.py would build now."""
    version = f"{bw.load_pin().version}+{bw.local_version()}"
    return version, bw.patches_record(bw.read_series()).decode("utf-8")


def installed(name: str = "sglang") -> tuple[str, str] | None:
    """(version, OFFLOAD_PATCHES text) of the installed distribution; None if not installed."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    return dist.version, dist.read_text("OFFLOAD_PATCHES") or ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only report whether the installed SGLang is the current patched wheel")
    parser.add_argument("--out", type=Path, default=HERE.parent / "dist", help="wheel directory")
    args = parser.parse_args(argv)
    bw = _build_wheel()
    try:
        version, record = wanted(bw)
        have = installed()
        if have == (version, record):  # quiet: scripts/install.sh runs this every time
            if args.check:
                print(f"install_patched: sglang {version} with this patches/series is installed")
            return 0
        state = "not installed" if have is None else f"sglang {have[0]} (other patches)"
        if args.check:
            print(f"install_patched: stale: {state}; want sglang {version}")
            return 1
        wheel = bw.build(args.out)
    except bw.BuildError as exc:
        print(f"install_patched: error: {exc}", file=sys.stderr)
        return 1
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                             "--force-reinstall", "--disable-pip-version-check", str(wheel)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        print(f"install_patched: pip failed:\n{result.stdout}{result.stderr}", file=sys.stderr)
        return 1
    print(f"install_patched: installed {wheel.name} (was: {state})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
