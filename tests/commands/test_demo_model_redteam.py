"""Red team of `sglang-offload demo-model DIR`: its refusals, what it leaves in DIR, and the
"already holds the verified model" exit 0. No real conversion runs: `convert_gguf` is replaced by
one that writes small stand-in files (the wheel's GGUF is still located and checked for real), so
PROVENANCE.json is the one `write_real` writes (the stand-ins' sha256s pinned as the installed
versions' conversion). An attack that held is a plain test; a hole is a strict xfail naming the
fix (none left: each hole's test now passes)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
from pathlib import Path

import pytest

from offload import cli
from offload.commands import demo_model
from offload.demo import real
from offload.demo.real import PROVENANCE

WHY_NOT = real.real_model_available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"{WHY_NOT}")

MODEL_FILES = ("chat_template.jinja", "config.json", "generation_config.json",
               "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """`convert_gguf` writing small stand-ins (fresh files, no links): the calls made. The
    stand-ins' sha256s are the pins of the installed versions (`real.PINS`): their conversion."""
    calls: list[Path] = []
    wheel = real.locate_wheel()
    pins = {n: hashlib.sha256(f"stand-in {n}\n".encode()).hexdigest() for n in MODEL_FILES}
    pins |= {"LICENSE": _sha(wheel.license),
             "README.md": hashlib.sha256(real._readme(wheel).encode()).hexdigest()}
    monkeypatch.setattr(real, "PINS", {real.installed_versions(): pins})

    def convert(gguf: Path, out: Path) -> None:
        calls.append(out)
        for name in MODEL_FILES:
            (out / name).write_text(f"stand-in {name}\n")

    monkeypatch.setattr(real, "convert_gguf", convert)
    return calls


def _snapshot(d: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() and not p.is_symlink()
                                    else os.readlink(p).encode() if p.is_symlink() else b"",
                                    p.lstat().st_mode)
            for p in sorted(d.rglob("*"))}


def _one_error(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "Traceback" not in err and "internal error" not in err
    return err.strip()


def _made(d: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    assert cli.main(["demo-model", str(d)]) == 0
    capsys.readouterr()
    assert real.verify_real(d) == []
    return d


def _holds(d: Path, capsys: pytest.CaptureFixture[str]) -> bool:
    """Run `demo-model DIR` again: True where it answered "already holds" (exit 0)."""
    before = _snapshot(d)
    rc = cli.main(["demo-model", str(d)])
    out, err = capsys.readouterr()
    assert _snapshot(d) == before
    if rc == 0:
        assert out.startswith(f"{d} already holds SmolLM2-135M-Instruct"), out
        return True
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: DIR: "), err
    return False


def _rewrite_provenance(d: Path, change) -> None:
    prov = json.loads((d / PROVENANCE).read_text())
    change(prov)
    (d / PROVENANCE).write_text(json.dumps(prov))


def _sha(p: Path) -> str:
    return real._sha256(p)


# --- the "already holds the verified model" exit 0 -------------------------------------------------
def test_the_verified_model_is_recognised_and_a_changed_file_is_not(fake: list[Path],
                                                                    tmp_path: Path,
                                                                    capsys) -> None:
    d = _made(tmp_path / "m", capsys)
    assert _holds(d, capsys) and len(fake) == 1
    for name in (*MODEL_FILES, "LICENSE", "README.md"):
        body = (d / name).read_bytes()
        (d / name).write_bytes(body + b" ")
        assert not _holds(d, capsys), name
        (d / name).write_bytes(body)
        (d / name).unlink()
        assert not _holds(d, capsys), name               # a listed file missing
        (d / name).write_bytes(body)
    assert _holds(d, capsys) and len(fake) == 1


@pytest.mark.parametrize("text", ["", "{", "[]", '{"format": 2}', "null",
                                  '{"format": 1, "source": {"sha256": "' + "0" * 64 + '"}}'])
def test_a_garbage_provenance_is_not_the_model(text: str, fake: list[Path], tmp_path: Path,
                                               capsys) -> None:
    d = _made(tmp_path / "m", capsys)
    (d / PROVENANCE).write_text(text)
    assert not _holds(d, capsys)


@pytest.mark.parametrize("name", ["../m/config.json", "/etc/passwd", "", ".", "..", "sub/x"])
def test_a_provenance_naming_a_path_outside_is_not_the_model(name: str, fake: list[Path],
                                                             tmp_path: Path, capsys) -> None:
    d = _made(tmp_path / "m", capsys)
    _rewrite_provenance(d, lambda p: p["files"].update({name: "0" * 64}))
    assert not _holds(d, capsys)


def test_an_unlisted_extra_weights_file_is_not_the_verified_model(fake: list[Path],
                                                                  tmp_path: Path,
                                                                  capsys) -> None:
    d = _made(tmp_path / "m", capsys)
    (d / "model-extra.safetensors").write_bytes(b"someone else's tensors")
    assert not _holds(d, capsys)


def test_a_provenance_listing_fewer_files_does_not_verify_the_rest(fake: list[Path],
                                                                   tmp_path: Path,
                                                                   capsys) -> None:
    d = _made(tmp_path / "m", capsys)
    _rewrite_provenance(d, lambda p: p.update(
        files={"model.safetensors": p["files"]["model.safetensors"]}))
    (d / "config.json").write_text('{"num_hidden_layers": 99}')
    assert not _holds(d, capsys)


def test_a_swapped_model_with_a_matching_provenance_is_not_the_verified_model(
        fake: list[Path], tmp_path: Path, capsys) -> None:
    d = _made(tmp_path / "m", capsys)
    (d / "model.safetensors").write_bytes(b"another model's weights")
    _rewrite_provenance(d, lambda p: p["files"].update(
        {"model.safetensors": _sha(d / "model.safetensors")}))
    assert not _holds(d, capsys)


def test_a_fifo_provenance_does_not_hang(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    os.mkfifo(d / PROVENANCE)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(demo_model._holds_it(str(d), real.verify_real)),
                         daemon=True)
    t.start()
    t.join(3.0)
    hung = t.is_alive()
    if hung:                                     # unblock the reader: a writer opens and closes
        os.close(os.open(d / PROVENANCE, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5.0)
    assert not hung and got == [False]


def test_a_symlink_dir_to_the_verified_model_exits_0_writing_nothing(fake: list[Path],
                                                                     tmp_path: Path,
                                                                     capsys) -> None:
    """Held, with a difference: the exit-0 path follows a DIR that is a symbolic link (write_real
    refuses one); nothing is written either way."""
    d = _made(tmp_path / "m", capsys)
    os.symlink(d, tmp_path / "link")
    assert _holds(tmp_path / "link", capsys) and len(fake) == 1
    (tmp_path / "empty").mkdir()
    os.symlink(tmp_path / "empty", tmp_path / "link2")
    for argv in ([str(tmp_path / "link2")], [str(tmp_path / "link2"), "--force"]):
        assert cli.main(["demo-model", *argv]) == 2
        assert "is a symbolic link" in _one_error(capsys)
    assert os.listdir(tmp_path / "empty") == [] and len(fake) == 1


# --- writing: nothing already there touched ---------------------------------------------------------
def test_force_replaces_a_linked_model_file_not_its_target(fake: list[Path], tmp_path: Path,
                                                           capsys) -> None:
    mine = tmp_path / "mine.json"
    mine.write_text("my precious config")
    d = tmp_path / "m"
    d.mkdir()
    os.symlink(mine, d / "config.json")
    (d / "keep.txt").write_text("keep")
    assert cli.main(["demo-model", str(d), "--force"]) == 0
    assert mine.read_text() == "my precious config" and not (d / "config.json").is_symlink()
    assert (d / "keep.txt").read_text() == "keep"          # kept, so DIR is not only the model:
    assert real.verify_real(d) == [f"{d / 'keep.txt'}: not a file of the model (not in {PROVENANCE})"]


def test_force_refuses_a_directory_under_a_model_file_s_name_touching_nothing(
        fake: list[Path], tmp_path: Path, capsys) -> None:
    d = _made(tmp_path / "m", capsys)
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").mkdir()
    (d / "tokenizer.json" / "x").write_text("x")
    before = _snapshot(d)
    assert cli.main(["demo-model", str(d), "--force"]) == 2
    assert "is a directory" in _one_error(capsys) and _snapshot(d) == before
    assert sorted(os.listdir(tmp_path)) == ["m"]


def test_a_dir_turned_into_a_symlink_while_converting_is_refused(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "m"

    def someone_links(gguf: Path, stage: Path) -> None:
        os.symlink(elsewhere, out)
        for name in MODEL_FILES:
            (stage / name).write_text("x")

    monkeypatch.setattr(real, "convert_gguf", someone_links)
    rc = cli.main(["demo-model", str(out)])
    capsys.readouterr()
    assert os.listdir(elsewhere) == [] and rc == 2


def test_force_failing_midway_leaves_dir_as_it_was(fake: list[Path], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys) -> None:
    d = _made(tmp_path / "m", capsys)
    (d / "keep.txt").write_text("keep")
    before = _snapshot(d)
    replace = os.replace

    def cross_device(src, dst, *a, **k):
        if Path(src).parent != Path(dst).parent:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", cross_device)
    rc = cli.main(["demo-model", str(d), "--force"])
    capsys.readouterr()
    assert rc == 2 and _snapshot(d) == before


def test_an_empty_dir_argument_is_refused(fake: list[Path], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    rc = cli.main(["demo-model", ""])
    capsys.readouterr()
    assert os.listdir(tmp_path / "cwd") == [] and rc == 2


def test_a_too_long_dir_name_is_one_dir_error_exit_2(fake: list[Path], tmp_path: Path,
                                                     capsys) -> None:
    rc = cli.main(["demo-model", str(tmp_path / ("x" * 300))])
    err = _one_error(capsys)
    assert os.listdir(tmp_path) == []
    assert rc == 2 and err.startswith("error: DIR: "), (rc, err)


def test_a_dir_under_a_file_or_proc_is_one_error_line(fake: list[Path], tmp_path: Path,
                                                      capsys) -> None:
    (tmp_path / "f").write_text("x")
    for argv in ([str(tmp_path / "f")], [str(tmp_path / "f" / "m")], [str(tmp_path / "f"), "--force"],
                 ["/proc/self/demo"], ["/proc/1"], ["/proc/1", "--force"]):
        assert cli.main(["demo-model", *argv]) == 2, argv
        assert _one_error(capsys).startswith("error: DIR: "), argv
    assert os.listdir(tmp_path) == ["f"] and fake == []


# --- --random: the same promises --------------------------------------------------------------------
SMALL = ["--layers", "1", "--hidden", "64", "--heads", "2", "--kv-heads", "1", "--vocab", "300"]


@pytest.mark.parametrize("name", [
    "config.json",
    "model.safetensors",          # held: safetensors replaces the link, not its target
])
def test_random_force_does_not_write_through_a_link(name: str, tmp_path: Path, capsys) -> None:
    mine = tmp_path / "precious"
    mine.write_bytes(b"my file")
    d = tmp_path / "m"
    d.mkdir()
    os.symlink(mine, d / name)
    assert cli.main(["demo-model", "--random", str(d), "--force", *SMALL]) == 0
    capsys.readouterr()
    assert mine.read_bytes() == b"my file"


@pytest.mark.parametrize("force", [False, True])
def test_random_failing_midway_leaves_nothing(force: bool, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    d = tmp_path / "m"
    if force:
        assert cli.main(["demo-model", "--random", str(d), *SMALL]) == 0
    capsys.readouterr()
    before = _snapshot(tmp_path)
    import safetensors.torch

    def disk_full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    argv = ["demo-model", "--random", str(d), "--layers", "2", *SMALL[2:]]
    assert cli.main(argv + (["--force"] if force else [])) == 2
    assert "No space left" in _one_error(capsys)
    assert _snapshot(tmp_path) == before


# --- the fixes, further ------------------------------------------------------------------------------
def test_force_failing_at_a_later_file_puts_every_replaced_file_back(
        fake: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    d = _made(tmp_path / "m", capsys)
    (d / "keep.txt").write_text("keep")
    (d / "config.json").unlink()                         # one file to add, not replace
    before = _snapshot(d)
    replace, calls = os.replace, []

    def fails_at_the_fifth(src, dst, *a, **k):
        calls.append(dst)
        if len(calls) == 5:
            raise OSError(errno.EIO, "Input/output error")
        return replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", fails_at_the_fifth)
    assert cli.main(["demo-model", str(d), "--force"]) == 2
    assert _one_error(capsys).startswith(f"error: DIR: cannot write {d}: Input/output error")
    assert len(calls) > 5 and _snapshot(d) == before and sorted(os.listdir(tmp_path)) == ["m"]


def test_unpinned_versions_check_the_record_only_and_never_hold(
        fake: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    d = _made(tmp_path / "m", capsys)
    monkeypatch.setattr(real, "PINS", {})
    assert real.verify_real(d, pinned=False) == []
    assert "not the versions of a pinned conversion" in real.verify_real(d)[0]
    assert not _holds(d, capsys)
    assert real.cached_real_model(tmp_path / "cache").is_dir() and len(fake) == 2


def test_an_existing_dir_swapped_while_converting_is_refused(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys) -> None:
    out = tmp_path / "m"
    out.mkdir()

    def someone_swaps(gguf: Path, stage: Path) -> None:
        out.rename(tmp_path / "old")
        out.mkdir()
        for name in MODEL_FILES:
            (stage / name).write_text("x")

    monkeypatch.setattr(real, "convert_gguf", someone_swaps)
    assert cli.main(["demo-model", str(out)]) == 2
    assert "was replaced while writing (now another directory)" in _one_error(capsys)
    assert sorted(os.listdir(tmp_path)) == ["m", "old"] and os.listdir(out) == []
    assert os.listdir(tmp_path / "old") == []


def test_random_into_an_existing_directory_keeps_it(tmp_path: Path, capsys) -> None:
    (tmp_path / "m").mkdir(mode=0o750)
    before = (tmp_path / "m").stat()
    assert cli.main(["demo-model", "--random", str(tmp_path / "m"), "--family", "swa", *SMALL]) == 0
    after = (tmp_path / "m").stat()
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert len(os.listdir(tmp_path / "m")) == 6 and os.listdir(tmp_path) == ["m"]


def test_random_still_writes_the_random_model(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo-model", "--random", str(tmp_path / "m"), *SMALL]) == 0
    assert "(llama, random weights)" in capsys.readouterr().out
    assert "RANDOM WEIGHTS" in (tmp_path / "m" / "README.md").read_text()
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_hidden_layers"] == 1


def test_a_mount_point_dir_is_staged_inside_it(fake: list[Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    d = tmp_path / "m"
    d.mkdir()
    stat_of = os.stat

    def other_device(path, *a, **k):          # DIR's parent on another file system than DIR
        st = stat_of(path, *a, **k)
        return os.stat_result((*st[:2], st.st_dev + 1, *st[3:])) if Path(path) == tmp_path else st

    monkeypatch.setattr(os, "stat", other_device)
    assert cli.main(["demo-model", str(d)]) == 0
    assert [p.parent for p in fake] == [d] and os.listdir(tmp_path) == ["m"]
    assert real.verify_real(d) == []
