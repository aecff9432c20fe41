"""The patched wheel: version, .dist-info, RECORD, nothing else changed, reproducible, installable."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _patched_paths(bw) -> set[str]:
    out = set()
    for patch in bw.read_series():
        for line in patch.read_text().splitlines():
            if line.startswith("+++ b/"):
                out.add(line[len("+++ b/"):].split("\t")[0])
    return out


def test_wheel_has_the_local_version_and_renamed_dist_info(bw, built_wheel):
    pin = bw.load_pin()
    version = f"{pin.version}+{bw.local_version()}"
    assert built_wheel.name == bw.pick_wheel(pin).replace("-0.5.23-", f"-{version}-")
    with zipfile.ZipFile(built_wheel) as zf:
        names = zf.namelist()
        info_dirs = {n.split("/")[0] for n in names if ".dist-info/" in n}
        assert info_dirs == {f"sglang-{version}.dist-info"}
        metadata = zf.read(f"sglang-{version}.dist-info/METADATA").decode()
        versions = [ln for ln in metadata.splitlines() if ln.startswith("Version:")]
        assert versions == [f"Version: {version}"]
        applied = zf.read(f"sglang-{version}.dist-info/OFFLOAD_PATCHES").decode().splitlines()[1:]
        assert [ln.split()[1] for ln in applied] == [p.name for p in bw.read_series()]
        for line in applied:
            digest, name = line.split()
            assert hashlib.sha256((REPO / "patches" / name).read_bytes()).hexdigest() == digest


def test_record_covers_every_file_with_its_hash_and_size(built_wheel):
    with zipfile.ZipFile(built_wheel) as zf:
        files = [n for n in zf.namelist() if not n.endswith("/")]
        record_name = next(n for n in files if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.StringIO(zf.read(record_name).decode())))
        assert sorted(r[0] for r in rows) == sorted(files)
        for path, digest, size in rows:
            if path == record_name:
                assert (digest, size) == ("", "")
                continue
            data = zf.read(path)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={expected}", path
            assert int(size) == len(data), path


def test_only_the_patched_files_and_dist_info_differ_from_upstream(bw, pinned_wheel, built_wheel):
    patched = _patched_paths(bw)
    with zipfile.ZipFile(pinned_wheel) as up, zipfile.ZipFile(built_wheel) as ours:
        up_info = {i.filename: i for i in up.infolist() if ".dist-info/" not in i.filename}
        our_info = {i.filename: i for i in ours.infolist() if ".dist-info/" not in i.filename}
        added = our_info.keys() - up_info.keys()
        assert up_info.keys() <= our_info.keys() and added <= patched  # only the patches add files
        changed = {n for n in up_info if not n.endswith("/") and up.read(n) != ours.read(n)}
        assert changed | added == patched
        for name, info in up_info.items():  # permissions and timestamps are kept
            assert (our_info[name].external_attr, our_info[name].date_time) == (
                info.external_attr, info.date_time)


def test_the_one_command_rebuilds_the_same_bytes(pinned_wheel, built_wheel, tmp_path):
    """`python distro/build_wheel.py` is the documented command; a rebuild is byte-identical."""
    out = tmp_path / "dist"
    result = subprocess.run(
        [sys.executable, str(REPO / "distro" / "build_wheel.py"), "--out", str(out),
         "--from-file", str(pinned_wheel)],
        capture_output=True, text=True, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    rebuilt = out / built_wheel.name
    assert str(rebuilt) in result.stdout
    assert rebuilt.read_bytes() == built_wheel.read_bytes()


def test_wheel_installs_into_a_plain_venv_and_its_modules_import(bw, patched_site, patched_probes):
    version = f"{bw.load_pin().version}+{bw.local_version()}"
    assert (patched_site / f"sglang-{version}.dist-info" / "RECORD").is_file()
    patched = sorted(_patched_paths(bw))
    # Byte-compile in the scratch venv's own interpreter (it has no torch, so no import there).
    python = patched_site.parents[2] / "bin" / "python"
    files = [str(patched_site / p) for p in patched]
    subprocess.run([str(python), "-m", "py_compile", *files], check=True)
    modules = sorted(p[: -len(".py")].replace("/", ".") for p in patched if p.endswith(".py"))
    # Import them from the scratch install with this .venv's dependencies (tests/distro/probe_imports.py).
    result = patched_probes["imports"]
    assert result["sglang_file"].startswith(str(patched_site))
    assert sorted(result["modules"]) == modules
    assert all(path.startswith(str(patched_site)) for path in result["modules"].values())
    assert result["version"] == version
