"""The pinned upstream (distro/upstream.toml), the local version and the download check."""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

import pytest


def test_pin_names_every_upstream_wheel_with_its_sha256(bw):
    pin = bw.load_pin()
    assert (pin.name, pin.version) == ("sglang", "0.5.23")
    assert len(pin.wheels) == 6  # cp311/cp312/cp313 x x86_64/aarch64, all PyPI publishes
    for name, digest in pin.wheels.items():
        assert re.fullmatch(r"sglang-0\.5\.23-(cp31[123])-\1-manylinux_2_34_(x86_64|aarch64)\.whl", name)
        assert re.fullmatch(r"[0-9a-f]{64}", digest)


def test_this_interpreter_gets_its_own_wheel(bw):
    name = bw.pick_wheel(bw.load_pin())
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert f"-{tag}-{tag}-" in name


def test_downloaded_wheel_matches_the_pin(bw, pinned_wheel):
    pin = bw.load_pin()
    expected = pin.wheels[pinned_wheel.name]
    assert hashlib.sha256(pinned_wheel.read_bytes()).hexdigest() == expected


def test_a_wheel_with_another_hash_is_refused(bw, tmp_path):
    pin = bw.load_pin()
    fake = tmp_path / bw.pick_wheel(pin)
    fake.write_bytes(b"not the pinned wheel")
    with pytest.raises(bw.BuildError, match="does not match the pinned"):
        bw.build(tmp_path / "dist", from_file=fake)
    assert not (tmp_path / "dist").exists() or not any((tmp_path / "dist").iterdir())


def test_an_unpinned_wheel_name_is_refused(bw):
    with pytest.raises(bw.BuildError, match="not pinned"):
        bw.pick_wheel(bw.load_pin(), "sglang-0.5.22-cp311-cp311-manylinux_2_34_x86_64.whl")


def test_local_version_comes_from_distro_local_version(bw, tmp_path):
    assert re.fullmatch(r"offload\.[1-9][0-9]*", bw.local_version())
    bad = tmp_path / "local-version"
    for text in ("# nothing\n", "0\n", "1\n2\n", "one\n"):
        bad.write_text(text)
        with pytest.raises(bw.BuildError, match="positive integer"):
            bw.local_version(bad)
    bad.write_text("# comment\n7\n")
    assert bw.local_version(bad) == "offload.7"


def test_a_broken_pin_file_names_the_problem(bw, tmp_path: Path):
    pin = tmp_path / "upstream.toml"
    pin.write_text('[sglang]\nname = "sglang"\nversion = "0.5.23"\n[sglang.wheels]\n"x.whl" = "ab"\n')
    with pytest.raises(bw.BuildError, match="is not a sglang 0.5.23 wheel"):
        bw.load_pin(pin)
    pin.write_text("[sglang]\n")
    with pytest.raises(bw.BuildError, match="cannot read the pin"):
        bw.load_pin(pin)


def test_fetch_downloads_and_verifies_any_pinned_wheel(bw, tmp_path):
    """A real `pip download --require-hashes` of a wheel for another Python and machine (the
    Docker build may target those); a download failure fails the test."""
    pin = bw.load_pin()
    name = "sglang-0.5.23-cp312-cp312-manylinux_2_34_aarch64.whl"
    got = bw.fetch_wheel(pin, name, tmp_path / "cache")
    assert got == tmp_path / "cache" / name
    assert hashlib.sha256(got.read_bytes()).hexdigest() == pin.wheels[name]
    assert bw.fetch_wheel(pin, name, tmp_path / "cache") == got  # second call: from the cache
