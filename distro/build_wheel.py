"""Build the patched SGLang wheel from the pinned upstream wheel and patches/series.

    .venv/bin/python distro/build_wheel.py            # -> dist/sglang-0.5.23+offload.N-<tags>.whl
    .venv/bin/python distro/build_wheel.py --check    # does patches/series still apply cleanly?

Primitives, in the order `build()` runs them:
  load_pin()        distro/upstream.toml: the SGLang version and the sha256 of every upstream wheel
  local_version()   distro/local-version: N of the local version `<version>+offload.N`
  pick_wheel()      the pinned wheel for this interpreter and machine (or the one named)
  fetch_wheel()     `pip download --no-deps --require-hashes` into a cache, then our own sha256 check
  read_series()     patches/series, quilt style: one patch per line, applied in order
  patch_tree()      unpack the wheel and apply the series (`patch -p1 --fuzz=0`, or the pure-Python
                    distro/apply_patch.py when `patch` is not installed)
  repack()          rename the .dist-info directory, set METADATA Version, record the applied
                    patches, rewrite RECORD (sha256 + size of every file), zip with the upstream
                    entry order, timestamps and permissions, so a rebuild gives the same bytes
Control-path errors are BuildError with a message naming what was wrong. This is a script, not a
package: `distro` is the name of a PyPI package SGLang depends on, so nothing here is importable as
`distro.*`; tests load this file by path.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.util
import io
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PIN_FILE = HERE / "upstream.toml"
LOCAL_VERSION_FILE = HERE / "local-version"
PATCHES_DIR = REPO / "patches"
DEFAULT_CACHE = Path.home() / ".cache" / "sglang-offload" / "wheels"
PATCHES_RECORD = "OFFLOAD_PATCHES"  # file added to the .dist-info directory


class BuildError(Exception):
    """The build cannot go on; the message says what was wrong and where."""


@dataclass(frozen=True)
class Pin:
    """The pinned upstream release: distribution name, version, wheel file name -> sha256."""

    name: str
    version: str
    wheels: dict[str, str]


def load_pin(path: Path = PIN_FILE) -> Pin:
    """Read and check distro/upstream.toml."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        table = data["sglang"]
        pin = Pin(str(table["name"]), str(table["version"]), dict(table["wheels"]))
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
        raise BuildError(f"{path}: cannot read the pin ({exc!r})") from exc
    for wheel, digest in pin.wheels.items():
        if not wheel.startswith(f"{pin.name}-{pin.version}-") or not wheel.endswith(".whl"):
            raise BuildError(f"{path}: wheel {wheel!r} is not a {pin.name} {pin.version} wheel")
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise BuildError(f"{path}: sha256 of {wheel} must be 64 lowercase hex digits")
    if not pin.wheels:
        raise BuildError(f"{path}: [sglang.wheels] lists no wheel")
    return pin


def local_version(path: Path = LOCAL_VERSION_FILE) -> str:
    """`offload.N` from distro/local-version (its first line that is not a comment)."""
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    values = [ln for ln in lines if ln and not ln.startswith("#")]
    if len(values) != 1 or not values[0].isdigit() or int(values[0]) < 1:
        raise BuildError(f"{path}: expected one positive integer, got {values!r}")
    return f"offload.{int(values[0])}"


def pick_wheel(pin: Pin, wanted: str | None = None) -> str:
    """The pinned wheel named `wanted`, or the one for this interpreter and machine."""
    if wanted is not None:
        if wanted not in pin.wheels:
            raise BuildError(f"wheel {wanted!r} is not pinned; pinned: {sorted(pin.wheels)}")
        return wanted
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    suffix = f"-{tag}-{tag}-manylinux_2_34_{platform.machine()}.whl"
    matches = [w for w in pin.wheels if w.endswith(suffix)]
    if len(matches) != 1:
        raise BuildError(
            f"no pinned wheel for {tag} on {platform.machine()}; pass --wheel, one of {sorted(pin.wheels)}"
        )
    return matches[0]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify(path: Path, expected: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise BuildError(f"{path}: sha256 {actual} does not match the pinned {expected}")


def _pip_target_args(wheel: str) -> list[str]:
    # sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl -> python 3.11, abi cp311, that platform
    _, _, py_tag, abi_tag, plat_tag = wheel[: -len(".whl")].split("-")
    version = f"{py_tag[2]}.{py_tag[3:]}"
    return ["--platform", plat_tag, "--python-version", version, "--implementation", "cp",
            "--abi", abi_tag, "--only-binary=:all:"]


def fetch_wheel(pin: Pin, wheel: str, cache_dir: Path = DEFAULT_CACHE) -> Path:
    """The verified pinned wheel: from the cache when its hash matches, else from pip download."""
    expected = pin.wheels[wheel]
    cached = cache_dir / wheel
    if cached.is_file() and sha256_of(cached) == expected:
        return cached
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(f"{pin.name}=={pin.version} --hash=sha256:{expected}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
               "--disable-pip-version-check", "-d", tmp, "-r", str(requirements),
               *_pip_target_args(wheel)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / wheel
        if result.returncode != 0 or not got.is_file():
            raise BuildError(f"pip download of {wheel} failed:\n{result.stdout}{result.stderr}")
        verify(got, expected)
        os.replace(got, cached)
    return cached


def read_series(patches_dir: Path = PATCHES_DIR) -> list[Path]:
    """The patches named by patches/series, in order (quilt format; only `-p1` is accepted)."""
    series = patches_dir / "series"
    out: list[Path] = []
    for number, raw in enumerate(series.read_text(encoding="utf-8").splitlines(), start=1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        if words[1:] not in ([], ["-p1"]):
            raise BuildError(f"{series}:{number}: only '<patch> [-p1]' is supported, got {raw!r}")
        path = patches_dir / words[0]
        if not path.is_file():
            raise BuildError(f"{series}:{number}: {words[0]} does not exist in {patches_dir}")
        out.append(path)
    return out


def _load_applier():
    """distro/apply_patch.py, loaded by path (this directory is not a package)."""
    name = "_sglang_offload_apply_patch"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "apply_patch.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[name]


def apply_one(patch_file: Path, tree: Path, applier: str) -> list[str]:
    """Apply one patch with `patch` (fuzz 0) or the Python applier; return notes on moved hunks."""
    if applier == "auto":
        applier = "patch" if shutil.which("patch") else "python"
    if applier == "python":
        module = _load_applier()
        try:
            return module.apply_patch(patch_file, tree, 1)
        except module.PatchError as exc:
            raise BuildError(f"{patch_file.name} does not apply: {exc}") from exc
    if applier != "patch":
        raise BuildError(f"unknown applier {applier!r}: expected auto, patch or python")
    # Dry run first so a failing patch leaves nothing half-applied.
    base = ["patch", "-p1", "--batch", "--forward", "--fuzz=0", "--no-backup-if-mismatch",
            "-r", "-", "-d", str(tree), "-i", str(patch_file)]
    for cmd in (base + ["--dry-run"], base):
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildError(f"{patch_file.name} does not apply:\n{result.stdout}{result.stderr}")
    return [ln for ln in result.stdout.splitlines() if "offset" in ln or "fuzz" in ln]


def touched_files(patches: list[Path]) -> list[str]:
    """Wheel-relative paths the patches read or write (their `--- a/` / `+++ b/` names)."""
    out: set[str] = set()
    for patch_file in patches:
        for line in patch_file.read_text(encoding="utf-8").splitlines():
            if line.startswith(("--- a/", "+++ b/")):
                out.add(line[len("--- a/"):].split("\t")[0].strip())
    return sorted(out)


def patch_tree(wheel_path: Path, tree: Path, patches: list[Path], applier: str = "auto",
               only_touched: bool = False) -> list[str]:
    """Unpack `wheel_path` into `tree` (only the files the patches touch, if `only_touched`) and
    apply `patches` in order; return notes on hunks that moved."""
    with zipfile.ZipFile(wheel_path) as zf:
        if only_touched:
            present = set(zf.namelist())
            zf.extractall(tree, [name for name in touched_files(patches) if name in present])
        else:
            zf.extractall(tree)
    notes: list[str] = []
    for patch_file in patches:
        notes.extend(f"{patch_file.name}: {n}" for n in apply_one(patch_file, tree, applier))
    return notes


def record_digest(data: bytes) -> str:
    """RECORD's hash field: sha256, urlsafe base64 without padding."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _set_version(metadata: bytes, version: str) -> bytes:
    lines = metadata.decode("utf-8").split("\n")
    hits = [i for i, ln in enumerate(lines) if ln.startswith("Version: ")]
    if len(hits) != 1:
        raise BuildError(f"METADATA has {len(hits)} 'Version:' lines, expected 1")
    lines[hits[0]] = f"Version: {version}"
    return "\n".join(lines).encode("utf-8")


def patches_record(patches: list[Path]) -> bytes:
    """The OFFLOAD_PATCHES file: a comment line, then `sha256 name` of each patch, in order."""
    lines = ["# patches/series applied to this wheel, in order: sha256 name"]
    lines += [f"{sha256_of(p)} {p.name}" for p in patches]
    return ("\n".join(lines) + "\n").encode("utf-8")


def repack(original: Path, tree: Path, out: Path, pin: Pin, version: str, patches: list[Path]) -> None:
    """Zip `tree` as the wheel `out` for `version`, keeping `original`'s entry order and attributes."""
    old_info = f"{pin.name}-{pin.version}.dist-info/"
    new_info = f"{pin.name}-{version}.dist-info/"
    record_name = new_info + "RECORD"
    with zipfile.ZipFile(original) as src:
        infos = src.infolist()
    known = {i.filename for i in infos}
    stamp = next(i.date_time for i in infos if i.filename == old_info + "METADATA")
    added = sorted(  # files a patch created (0005 adds pool_host/torch_transfer.py)
        p.relative_to(tree).as_posix() for p in tree.rglob("*")
        if p.is_file() and p.relative_to(tree).as_posix() not in known
    )
    entries = [(i.filename, i) for i in infos] + [(name, None) for name in added]
    entries.append((old_info + PATCHES_RECORD, None))
    record: list[tuple[str, str, str]] = []
    with zipfile.ZipFile(out, "w") as dst:
        for name, info in entries:
            path = tree / name
            new_name = new_info + name[len(old_info):] if name.startswith(old_info) else name
            if new_name == record_name:
                continue  # written last
            zinfo = zipfile.ZipInfo(new_name, info.date_time if info else stamp)
            zinfo.external_attr = info.external_attr if info else 0o644 << 16
            zinfo.create_system = info.create_system if info else 3
            compress = info.compress_type if info else zipfile.ZIP_DEFLATED
            if name.endswith("/"):
                dst.writestr(zinfo, b"", compress_type=compress)
                continue
            if name == old_info + PATCHES_RECORD:
                data = patches_record(patches)
            elif not path.is_file():
                continue  # a patch deleted it
            else:
                data = path.read_bytes()
            if name == old_info + "METADATA":
                data = _set_version(data, version)
            dst.writestr(zinfo, data, compress_type=compress)
            record.append((new_name, record_digest(data), str(len(data))))
        record.append((record_name, "", ""))
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(record)  # names may contain commas
        zinfo = zipfile.ZipInfo(record_name, stamp)
        zinfo.external_attr = 0o644 << 16
        zinfo.create_system = 3
        dst.writestr(zinfo, text.getvalue().encode("utf-8"), compress_type=zipfile.ZIP_DEFLATED)


def check(wheel: str | None = None, from_file: Path | None = None,
          cache_dir: Path = DEFAULT_CACHE, applier: str = "auto") -> list[str]:
    """Apply the series to the pinned wheel's files without building; return notes on moved hunks."""
    source, _ = _source(load_pin(), wheel, from_file, cache_dir)
    with tempfile.TemporaryDirectory(prefix="sglang-offload-check-") as tmp:
        return patch_tree(source, Path(tmp), read_series(), applier, only_touched=True)


def _source(pin: Pin, wheel: str | None, from_file: Path | None, cache_dir: Path) -> tuple[Path, str]:
    """The verified pinned wheel to build from, and its file name."""
    name = pick_wheel(pin, from_file.name if from_file is not None else wheel)
    if from_file is not None:
        verify(from_file, pin.wheels[name])
        return from_file, name
    return fetch_wheel(pin, name, cache_dir), name


def build(out_dir: Path, wheel: str | None = None, from_file: Path | None = None,
          cache_dir: Path = DEFAULT_CACHE, applier: str = "auto") -> Path:
    """Run the whole build; return the path of the patched wheel in `out_dir`."""
    pin = load_pin()
    version = f"{pin.version}+{local_version()}"
    source, name = _source(pin, wheel, from_file, cache_dir)
    patches = read_series()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / name.replace(f"-{pin.version}-", f"-{version}-", 1)
    with tempfile.TemporaryDirectory(prefix="sglang-offload-build-") as tmp:
        tree = Path(tmp) / "tree"
        for note in patch_tree(source, tree, patches, applier):
            print(f"note: {note}", file=sys.stderr)
        partial = Path(tmp) / target.name
        repack(source, tree, partial, pin, version, patches)
        shutil.move(partial, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the patched SGLang wheel into dist/.")
    parser.add_argument("--out", type=Path, default=REPO / "dist", help="output directory (dist/)")
    parser.add_argument("--wheel", help="pinned wheel file name to build (default: this interpreter)")
    parser.add_argument("--from-file", type=Path, help="use this local copy of a pinned wheel")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="download cache")
    parser.add_argument("--applier", choices=["auto", "patch", "python"], default="auto",
                        help="`patch` program or the pure-Python applier (auto: patch if installed)")
    parser.add_argument("--check", action="store_true",
                        help="only check that patches/series applies cleanly (no offset, no fuzz)")
    args = parser.parse_args(argv)
    try:
        if args.check:
            notes = check(args.wheel, args.from_file, args.cache_dir, args.applier)
            for note in notes:
                print(f"not clean: {note}")
            print("patches/series applies cleanly" if not notes else "patches/series needs a refresh")
            return 1 if notes else 0
        target = build(args.out, args.wheel, args.from_file, args.cache_dir, args.applier)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{target}  sha256={sha256_of(target)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
