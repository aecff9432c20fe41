"""A config file that is wrong is refused, each stumble with one `error:` line and exit 2, by
every command that reads it (`config validate`, `launch --dry-run`, `detect --config`); and
`config validate --offline` validates every shipped config on any machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from offload.config import load_offload
from tests.launch.helpers import CONFIGS, GPU_HOST, run_cli, write

BASE = "sglang:\n  model-path: meta-llama/Llama-3.1-8B-Instruct\n  page-size: 64\n"
SALT = "s3cret-tenant-salt-4e1f"
PASSWORD = "hunter2-redis-pw"


def refused(capsys: pytest.CaptureFixture[str], path: Path) -> str:
    """Every command reading the file exits 2 with exactly one `error:` line; that line."""
    lines = []
    for argv in (("config", "validate", str(path)), ("config", "validate", "--offline", str(path)),
                 ("launch", "--config", str(path), "--dry-run", "--root", GPU_HOST),
                 ("detect", "--config", str(path), "--root", GPU_HOST)):
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), (argv, err)
        assert "Traceback" not in out
        lines.append(err[0])
    assert len(set(lines)) == 1, lines
    return lines[0]


CASES = {
    "duplicate key": (BASE + "offload:\n  store:\n    capacity: 1TiB\n    min_free: 1GiB\n"
                      "    capacity: 2TiB\n",
                      "line 8: key 'capacity' is given twice (also line 6)"),
    "duplicate section": (BASE + "offload:\n  store: {capacity: 1TiB}\noffload:\n  metrics: {}\n",
                          "line 6: key 'offload' is given twice (also line 4)"),
    "duplicate sglang key": (BASE + "  page-size: 32\n",
                             "line 4: key 'page-size' is given twice (also line 3)"),
    "empty": ("", "holds no settings (empty, or comments only)"),
    "comments only": ("# a deployment\n\n# nothing yet\n", "holds no settings"),
    "path and paths": (BASE + "offload:\n  store:\n    path: /raid/a\n    paths: [/d1/a, /d2/a]\n",
                       "offload.store.path: set together with paths, which replaces it"),
    "relative path": (BASE + "offload:\n  store:\n    path: cache/sglang-offload\n",
                      "offload.store.path: 'cache/sglang-offload' is not an absolute path"),
    "salt and salt_file": (BASE + "offload:\n  store:\n    salt_file: /etc/salt\n    salt: x\n",
                           "offload.store.salt_file: set together with salt"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_wrong_file_is_one_error_line(capsys, tmp_path: Path, name: str) -> None:
    text, needle = CASES[name]
    path = write(tmp_path, text)
    line = refused(capsys, path)
    assert needle in line, line


@pytest.mark.parametrize("secret, key", [
    (f"offload:\n  store:\n    salt: {SALT}\n", "offload.store.salt"),
    (f"offload:\n  redis:\n    url: redis://app:{PASSWORD}@10.0.0.5:6379/0\n", "offload.redis.url"),
    (f"  api-key: {PASSWORD}\n", "sglang.api-key"),
])
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_secret_in_a_file_others_can_read_is_refused(capsys, tmp_path: Path, secret: str,
                                                       key: str, mode: int) -> None:
    path = write(tmp_path, BASE + secret, mode=mode)
    line = refused(capsys, path)
    assert line.startswith(f"error: {key}: {path} has mode {mode:o}, which lets other users read")
    assert f"chmod 600 {path}" in line and "offload.store.salt_file" in line
    assert SALT not in line and PASSWORD not in line
    path.chmod(0o600)                                     # private: accepted
    rc, out, _ = run_cli(capsys, "config", "validate", "--offline", str(path))
    assert rc == 0 and SALT not in out and PASSWORD not in out


def _nobody() -> int:
    import pwd

    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534


@pytest.mark.parametrize("secret, key", [
    (f"offload:\n  store:\n    salt: {SALT}\n", "offload.store.salt"),
    (f"offload:\n  redis:\n    url: redis://app:{PASSWORD}@10.0.0.5:6379/0\n", "offload.redis.url"),
])
@pytest.mark.parametrize("plant", ["owned by nobody", "symlink", "hard link"])
def test_a_secret_in_a_file_not_our_own_is_refused(capsys, tmp_path: Path, secret: str,
                                                   key: str, plant: str) -> None:
    """Issue 36 item 5 for a config file holding a secret: a mode-600 file planted by another
    user holds a salt (or a password) they know; a link lets whoever can write its directory
    choose the file. Refused by every command, as a secret file is."""
    import os

    if plant == "owned by nobody" and os.geteuid() != 0:
        pytest.skip("planting a file of another user needs root (chown)")
    real = write(tmp_path, BASE + secret, name="real.yaml")
    path = tmp_path / "deploy.yaml"
    if plant == "owned by nobody":
        os.rename(real, path)
        os.chown(path, _nobody(), -1)
    elif plant == "symlink":
        path.symlink_to(real)
    else:
        os.link(real, path)
    line = refused(capsys, path)
    assert line.startswith(f"error: {key}: {path} "), line
    assert {"owned by nobody": "belongs to", "symlink": "symbolic link",
            "hard link": "names (hard links)"}[plant] in line, line
    assert SALT not in line and PASSWORD not in line


@pytest.mark.timeout(120)
def test_a_fifo_config_is_refused_not_read(capsys, tmp_path: Path) -> None:
    import os

    path = tmp_path / "deploy.yaml"
    os.mkfifo(path, 0o600)                 # nobody writes it: a blocking read never returns
    assert "not a regular file" in refused(capsys, path)


def test_salt_file_keeps_the_config_world_readable(capsys, tmp_path: Path) -> None:
    salt = tmp_path / "salt"
    salt.write_text(SALT + "\n")
    salt.chmod(0o600)
    cfg = write(tmp_path, BASE + f"offload:\n  store:\n    path: {tmp_path / 'c'}\n"
                f"    salt_file: {salt}\n", mode=0o644)
    rc, out, err = run_cli(capsys, "config", "validate", str(cfg))
    assert rc == 0 and SALT not in out, err
    salt.chmod(0o644)
    rc, _, err = run_cli(capsys, "config", "validate", str(cfg))
    assert rc == 2 and err == [f"error: offload.store.salt_file: {salt} has mode 644, which lets "
                               f"other users read or change it; run `chmod 600 {salt}`"]
    rc, _, err = run_cli(capsys, "config", "validate", "--offline", str(cfg))
    assert rc == 0, err                                    # offline: the salt file is not read


def test_the_backend_reads_the_salt_file() -> None:
    backend = pytest.importorskip("offload.hicache.backend")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        salt = Path(d) / "salt"
        salt.write_text(SALT + "\n")
        salt.chmod(0o600)
        cfg = backend.settings_from_extra({"offload": {"store": {"path": d,
                                                                 "salt_file": str(salt)}}})
        assert cfg.store.salt == SALT and cfg.store.salt_file is None
    # an absolute path the rest of the tree accepts: a relative one is refused
    assert load_offload({"store": {"path": "/var/cache/x"}}).store.path == "/var/cache/x"


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_shipped_config_validates_offline(capsys, name: str) -> None:
    """On any machine (CI, a laptop): no secret, salt or TLS file of theirs exists here."""
    rc, out, err = run_cli(capsys, "config", "validate", "--offline", str(CONFIGS / name))
    assert rc == 0 and not [e for e in err if e.startswith("error:")], err
    assert "offload:" in out


def test_offline_still_refuses_what_is_wrong_in_the_file(capsys, tmp_path: Path) -> None:
    cfg = write(tmp_path, BASE + "offload:\n  redis:\n    url: redis://h:1\n    password_file: "
                f"{tmp_path / 'missing'}\n  transfer:\n    numa_node: 63\n")
    rc, _, err = run_cli(capsys, "config", "validate", str(cfg))
    assert rc == 2 and any("password_file" in e for e in err), err
    rc, _, err = run_cli(capsys, "config", "validate", "--offline", str(cfg))
    assert rc == 0, err
    bad = write(tmp_path, BASE + "offload:\n  store:\n    capacity: lots\n", "bad.yaml")
    rc, _, err = run_cli(capsys, "config", "validate", "--offline", str(bad))
    assert rc == 2 and len(err) == 1 and "offload.store.capacity" in err[0]


@pytest.mark.parametrize("store", [{"paths": ["/d1/a", "/d2/a"]}, {"path": "/raid/a"}, {}])
def test_the_tree_launch_hands_the_backend_loads_again(tmp_path: Path, store: dict) -> None:
    """launch writes the effective offload tree (`to_dict`) for each scheduler's backend to load
    with the strict loader: a store on several drives must not come back as path + paths (CI, stop
    40: the two-drive E2E server exited at start-up)."""
    import yaml

    from offload.config import load_file, to_dict
    from offload.hicache.backend import settings_from_extra

    cfg = load_offload({"store": store})
    f = tmp_path / "settings.yaml"
    f.write_text(yaml.safe_dump({"offload": to_dict(cfg)}))
    f.chmod(0o600)
    assert load_file(f).offload == cfg
    assert settings_from_extra({"config_file": str(f)}) == cfg


def test_a_secret_in_a_file_in_a_directory_others_can_change_is_refused(capsys,
                                                                         tmp_path: Path) -> None:
    """The config file holding a secret is read by the one loader of secret files, directory walk
    included: another user who can write the directory could swap the file between runs."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)                                   # not sticky: others may rename in it
    path = write(shared, BASE + f"offload:\n  store:\n    salt: {SALT}\n", mode=0o600)
    line = refused(capsys, path)
    assert line.startswith("error: offload.store.salt: ") and str(shared) in line, line
    assert SALT not in line
