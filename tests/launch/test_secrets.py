"""Secrets stay off SGLang's command line (issue 14): `launch` writes the offload settings to a
0600 file in a private runtime directory and passes its path; `--dry-run` redacts them; the
backend loads the settings from that file."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from offload.errors import ConfigError
from offload.hicache.backend import settings_from_extra
from offload.launch.secrets import REDACTED, redact_url, runtime_dir
from tests.launch.helpers import GPU_HOST, REPO, dry_run, run_cli, write

SALT = "tenant-salt-7f3a9c"
PASSWORD = "redis-pw-51e0d2"
BASE = "sglang:\n  model-path: meta-llama/Llama-3.1-8B-Instruct\n  page-size: 64\n"


def deployment(tmp_path: Path) -> Path:
    return write(tmp_path, BASE + "offload:\n"
                 f"  store: {{path: {tmp_path / 'cache'}, salt: {SALT}}}\n"
                 f"  redis: {{url: 'redis://tenant-a:{PASSWORD}@127.0.0.1:6379', "
                 "key_prefix: 'sglo:tenant-a'}\n")


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "xdg"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(d))
    return d / "sglang-offload"


def test_dry_run_redacts_and_argv_carries_no_secret(capsys, tmp_path, runtime) -> None:
    cfg = deployment(tmp_path)
    out = dry_run(capsys, cfg)
    for secret in (SALT, PASSWORD):
        assert secret not in json.dumps(out), "a secret in launch's dry-run JSON"
        assert not any(secret in a for a in out["argv"])
    assert out["config"]["offload"]["store"]["salt"] == REDACTED
    assert out["config"]["offload"]["redis"]["url"] == \
        f"redis://tenant-a:{REDACTED}@127.0.0.1:6379"
    extra = json.loads(out["argv"][out["argv"].index("--hicache-storage-backend-extra-config") + 1])
    assert extra["config_file"] == out["settings_file"] == str(runtime / f"launch-{os.getpid()}.yaml")
    assert not Path(out["settings_file"]).exists(), "a dry run writes no settings file"
    rc, text, _ = run_cli(capsys, "launch", "--config", str(cfg), "--dry-run", "--root", GPU_HOST)
    assert rc == 0 and SALT not in text and PASSWORD not in text and REDACTED in text


def test_launch_writes_a_private_settings_file_the_backend_loads(tmp_path, runtime) -> None:
    """The real command, exec'ing a stand-in for python that reports what SGLang would see."""
    cfg = deployment(tmp_path)
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\n[ \"$1\" = -c ] && exec {sys.executable} \"$@\"  # launch's probe\n"
                    "tr '\\0' '\\n' < /proc/$$/cmdline\n")
    fake.chmod(0o755)
    code = "import sys; from offload import cli; sys.exit(cli.main(sys.argv[1:]))"
    res = subprocess.run([sys.executable, "-c", code, "launch", "--config", str(cfg),
                          "--python", str(fake), "--root", GPU_HOST], capture_output=True,
                         text=True, cwd=REPO, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO),
                                               XDG_RUNTIME_DIR=str(runtime.parent)))
    assert res.returncode == 0, res.stderr
    cmdline = res.stdout.splitlines()                 # SGLang's /proc/PID/cmdline
    assert SALT not in res.stdout and PASSWORD not in res.stdout
    extra = json.loads(cmdline[cmdline.index("--hicache-storage-backend-extra-config") + 1])
    path = Path(extra["config_file"])
    assert path.parent == runtime
    assert stat.S_IMODE(os.stat(runtime).st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600 and path.stat().st_uid == os.getuid()
    assert "--hicache-storage-backend" in cmdline and "offload" not in extra
    # What a scheduler process builds from SGLang's extra config: every setting, secrets too.
    settings = settings_from_extra(extra)
    assert settings.store.salt == SALT and PASSWORD in (settings.redis.url or "")
    assert settings.redis.key_prefix == "sglo:tenant-a"
    assert settings.transfer.path == "cpu" and settings.store.path == str(tmp_path / "cache")


def test_stale_settings_files_of_dead_launches_are_removed(tmp_path, runtime) -> None:
    from offload.launch.secrets import settings_path, write_settings

    runtime.mkdir(mode=0o700)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = settings_path(runtime, dead.pid)
    stale.write_text("offload: {}\n")
    mine = settings_path(runtime)
    write_settings(mine, {"store": {"salt": SALT}})
    assert not stale.exists() and stat.S_IMODE(mine.stat().st_mode) == 0o600
    write_settings(mine, {"store": {"salt": "again"}})          # a relaunch with the same pid
    assert "again" in mine.read_text()


def test_unsafe_runtime_directories_are_refused(tmp_path, monkeypatch) -> None:
    base = tmp_path / "xdg"
    base.mkdir()
    env = {"XDG_RUNTIME_DIR": str(base)}
    d = base / "sglang-offload"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    with pytest.raises(ConfigError, match="chmod 700"):
        runtime_dir(env)
    d.rmdir()
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    d.symlink_to(target)
    with pytest.raises(ConfigError, match="symlink"):
        runtime_dir(env)
    d.unlink()
    assert runtime_dir(env) == d and stat.S_IMODE(d.stat().st_mode) == 0o700


def test_redact_url_forms() -> None:
    assert redact_url("rediss+cluster://u:p@ss@h1:1,h2:2") == \
        f"rediss+cluster://u:{REDACTED}@h1:1,h2:2"
    assert redact_url("redis://:pw@h/1") == f"redis://:{REDACTED}@h/1"
    for plain in ("redis://h:6379", "redis://user@h", None):
        assert redact_url(plain) == plain


API_KEY = "sk-api-4d1e9b"


@pytest.mark.parametrize("flags", [
    ["--api-k", API_KEY], [f"--api-k={API_KEY}"], ["--admin-api", API_KEY],
    ["--ssl-keyfile-pass", API_KEY], [f"--admin-api={API_KEY}"]])
def test_abbreviated_secret_flags_after_dashdash_are_masked(capsys, tmp_path, runtime,
                                                             flags: list[str]) -> None:
    """SGLang's parser resolves unique prefixes (argparse): `--api-k` is `--api-key` to it, so it
    is masked by what the parser resolves it to, in the JSON and in the text."""
    cfg = deployment(tmp_path)
    out = dry_run(capsys, cfg, "--", *flags)
    assert API_KEY not in json.dumps(out), f"{flags} printed in the dry-run JSON"
    rc, text, err = run_cli(capsys, "launch", "--config", str(cfg), "--dry-run", "--root", GPU_HOST,
                            "--", *flags)
    assert rc == 0 and API_KEY not in text and API_KEY not in "\n".join(err)


@pytest.mark.parametrize("key", ["api-key", "admin-api-key", "ssl-keyfile-password"])
def test_a_secret_given_as_a_yaml_list_is_never_quoted_back(capsys, tmp_path, runtime,
                                                            key: str) -> None:
    cfg = write(tmp_path, BASE + f"  {key}: [{API_KEY}]\n")
    for argv in (["config", "validate", str(cfg)], ["config", "validate", str(cfg), "--json"],
                 ["launch", "--config", str(cfg), "--dry-run", "--root", GPU_HOST],
                 ["launch", "--config", str(cfg), "--dry-run", "--json", "--root", GPU_HOST]):
        rc, text, err = run_cli(capsys, *argv)
        assert rc != 0, argv
        assert API_KEY not in text + "\n".join(err), f"{key} quoted back by {argv}"
        assert "is a list" in text + "\n".join(err)


def test_redact_argv_resolves_flags_as_the_parser_does() -> None:
    import argparse

    from offload.redact import MASK, argv

    p = argparse.ArgumentParser()
    for flag in ("--api-key", "--admin-api-key", "--ssl-keyfile-password", "--ssl-keyfile",
                 "--apis"):
        p.add_argument(flag)
    assert argv(["--api-k", "s", "--ssl-keyfile", "f", "--apis", "x"], p) == \
        ["--api-k", MASK, "--ssl-keyfile", "f", "--apis", "x"]
    assert argv(["--ssl-keyfile-p=s", "--admin=s"], p) == [f"--ssl-keyfile-p={MASK}",
                                                           f"--admin={MASK}"]
    # Ambiguous for the parser (it refuses it): masked if any flag it may mean is a secret.
    assert argv(["--ap", "s"], p) == ["--ap", MASK]
