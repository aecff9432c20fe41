"""Every secret or key file is the service user's own private file, read by ONE loader.

Issue 36 item 5: a mode-0600 Redis secret file owned by `nobody`, planted first in a shared
directory, was accepted (the planter sealed its own block under that key and our tier served it
as ours); the agent's secret and keys files likewise (a keys file granting `namespaces = ["*"]`).
The promise (docs/security/redis.md#secrets-on-the-inference-host): every secret or key file
is read by `offload.secret` and refused unless it is a regular file, not a symbolic link,
owned by the effective uid, private, and bounded in size; each refusal is one line naming the
file and why.

The tests walk every reader (`READERS`: each place the package reads a secret file, from its
public entry point) over every kind of bad file (`BAD`), and scan the sources so that a new
reader cannot bypass the loader (`test_no_other_code_reads_a_secret_file`).
"""

from __future__ import annotations

import ast
import os
import pwd
import re
from pathlib import Path
from typing import Callable

import pytest

from offload import secret
from offload.config import AgentConfig, RedisConfig, StoreConfig, load_offload
from offload.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
KEY = b"0123456789abcdef0123456789abcdef\n"
KEYS_TOML = ('[hosts.a]\nsecret = "' + "a" * 32 + '"\nnamespaces = ["*"]\n').encode()


def _redis_secret(path: str) -> object:
    from offload.store.redis.store import RedisStore

    return RedisStore(RedisConfig(url="redis://127.0.0.1:1", secret_file=path))


def _redis_password(path: str) -> object:
    from offload.store.redis.link import RedisLink

    return RedisLink(RedisConfig(url="redis://127.0.0.1:1", password_file=path))


def _redis_tls_key(path: str) -> object:
    from offload.store.redis.link import RedisLink

    cfg = load_offload({"redis": {"url": "rediss://127.0.0.1:1", "tls_key_file": path,
                                  "tls_cert_file": "/dev/null"}})
    return RedisLink(cfg.redis)


def _agent_secret(path: str) -> object:
    from offload.agent.auth import load_secret

    return load_secret(path)


def _agent_client(path: str) -> object:
    from offload.agent.client import AgentStore

    cfg = load_offload({"agent": {"address": "127.0.0.1:1", "secret_file": path}})
    return AgentStore.from_config(cfg)


def _agent_keys(path: str) -> object:
    from offload.agent.auth import load_keys

    return load_keys(path)


def _salt(path: str) -> object:
    from offload.hicache.backend import resolve_salt  # in each scheduler, at attach

    return resolve_salt(load_offload({"store": {"salt_file": path}}))


def _salt_checks(path: str) -> object:
    from offload.launch.checks import salt_file_errors  # config validate, detect, launch

    errors = salt_file_errors(load_offload({"store": {"salt_file": path}}))
    if errors:
        raise ConfigError(errors)
    return None


def _checks_before_start(setting: str) -> Callable[[str], object]:
    """`config validate`, `detect`, `launch`: the host checks of the deployment's files."""
    def check(path: str) -> object:
        from offload.hw.host_checks import check_host

        section, key = setting.split(".")[1:]
        with_cert = {"tls_cert_file": "/dev/null"} if key == "tls_key_file" else {}
        cfg = load_offload({section: {key: path, **with_cert}})
        errors = [e for e in check_host(cfg, "/", cache_dir="/tmp").errors if path in e]
        if errors:
            raise ConfigError(errors)
        return None
    return check


# (name, the file's good content, the reader). Each reader of a secret file in the package.
READERS: list[tuple[str, bytes, Callable[[str], object]]] = [
    ("redis.secret_file", KEY, _redis_secret),
    ("redis.password_file", b"a-password\n", _redis_password),
    ("redis.tls_key_file", b"-----BEGIN PRIVATE KEY-----\n", _redis_tls_key),
    ("agent.secret_file (agent)", KEY, _agent_secret),
    ("agent.secret_file (host)", KEY, _agent_client),
    ("agent keys file", KEYS_TOML, _agent_keys),
    ("checks: redis.secret_file", KEY, _checks_before_start("offload.redis.secret_file")),
    ("checks: redis.password_file", b"pw", _checks_before_start("offload.redis.password_file")),
    ("checks: agent.secret_file", KEY, _checks_before_start("offload.agent.secret_file")),
    ("checks: redis.tls_key_file", KEY, _checks_before_start("offload.redis.tls_key_file")),
    ("store.salt_file", b"tenant-salt\n", _salt),
    ("checks: store.salt_file", b"tenant-salt\n", _salt_checks),
]


def _nobody() -> int:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534


def _plant_other_owner(d: Path, body: bytes) -> tuple[str, str]:
    p = d / "planted"
    p.write_bytes(body)
    p.chmod(0o600)
    os.chown(p, _nobody(), -1)
    return str(p), "belongs to"


def _plant_symlink(d: Path, body: bytes) -> tuple[str, str]:
    real = d / "real"                       # our own private file: the link alone is refused
    real.write_bytes(body)
    real.chmod(0o600)
    (d / "link").symlink_to(real)
    return str(d / "link"), "is a symbolic link"


def _plant_oversized(d: Path, body: bytes) -> tuple[str, str]:
    p = d / "big"
    p.write_bytes(body + b" " * (secret.MAX_KEYS_FILE_BYTES + 1))
    p.chmod(0o600)
    return str(p), "holds at most"


def _plant_open(d: Path, body: bytes) -> tuple[str, str]:
    p = d / "open"
    p.write_bytes(body)
    p.chmod(0o640)
    return str(p), "chmod 600"


def _plant_fifo(d: Path, body: bytes) -> tuple[str, str]:
    p = d / "fifo"
    os.mkfifo(p, 0o600)                     # never opened for writing: a read would block
    return str(p), "not a regular file"


def _ours(p: Path, body: bytes) -> Path:
    p.write_bytes(body)
    p.chmod(0o600)
    return p


def _plant_hard_link(d: Path, body: bytes) -> tuple[str, str]:
    # A second name of our own private file (planted where its directory lets someone, or
    # left where another user can later reach it): the file has two ways in.
    real = _ours(d / "real", body)
    os.link(real, d / "hardlink")
    return str(d / "hardlink"), "(hard links)"


def _plant_in_writable_dir(d: Path, body: bytes) -> tuple[str, str]:
    # Our own private file in a directory anyone can write (no sticky bit): another user can
    # rename it away and put another file of ours under its name between two runs.
    shared = d / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    return str(_ours(shared / "secret", body)), "other users can write"


def _plant_in_their_dir(d: Path, body: bytes) -> tuple[str, str]:
    theirs = d / "theirs"
    theirs.mkdir()
    p = _ours(theirs / "secret", body)
    os.chown(theirs, _nobody(), -1)         # their directory: they choose what it names
    return str(p), "which belongs to"


def _plant_their_dir_link(d: Path, body: bytes) -> tuple[str, str]:
    real = d / "realdir"
    real.mkdir()
    _ours(real / "secret", body)
    (d / "via").symlink_to(real)
    os.lchown(d / "via", _nobody(), -1)     # a directory link of another user on the way
    return str(d / "via" / "secret"), "is reached through the symbolic link"


BAD = {"owned by nobody": _plant_other_owner, "symlink": _plant_symlink,
       "oversized": _plant_oversized, "group-readable": _plant_open, "fifo": _plant_fifo,
       "hard link": _plant_hard_link, "in a world-writable directory": _plant_in_writable_dir,
       "in another user's directory": _plant_in_their_dir,
       "through another user's link": _plant_their_dir_link}
NEEDS_ROOT = {"owned by nobody", "in another user's directory", "through another user's link"}


@pytest.mark.timeout(120)       # a reader that blocks on the FIFO fails here, not at 600 s
@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("reader", [r[0] for r in READERS])
def test_every_reader_refuses_every_bad_secret_file(tmp_path: Path, reader: str, bad: str) -> None:
    if bad in NEEDS_ROOT and os.geteuid() != 0:
        pytest.skip("planting a file of another user needs root (chown)")
    body, read = next((b, f) for name, b, f in READERS if name == reader)
    good = tmp_path / "good"
    good.write_bytes(body)
    good.chmod(0o600)
    read(str(good))                                       # the good file is accepted
    path, why = BAD[bad](tmp_path, body)
    with pytest.raises(ConfigError) as e:
        read(path)
    assert len(e.value.problems) == 1, e.value.problems   # one line: the file and why
    line = e.value.problems[0]
    assert "\n" not in line and path in line and why in line, line


def test_a_nobody_keys_file_granting_everything_never_reaches_the_agent(tmp_path: Path,
                                                                       capsys) -> None:
    """The attack of issue 36 item 5 through the command: `agent --keys-file` with a keys file
    granting `namespaces = ["*"]`, planted by another user: one `error:` line, exit 2."""
    if os.geteuid() != 0:
        pytest.skip("planting a file of another user needs root (chown)")
    from offload.cli import main

    path, _why = _plant_other_owner(tmp_path, KEYS_TOML)
    rc = main(["agent", "--listen", "127.0.0.1:0", "--transport", "tcp", "--keys-file", path,
               "--store", str(tmp_path / "store")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: agent keys file: "), err
    assert path in err[0] and "belongs to" in err[0]


def test_the_loader_reads_a_good_file_and_bounds_it(tmp_path: Path) -> None:
    p = tmp_path / "s"
    p.write_bytes(b"  " + KEY)
    p.chmod(0o400)
    assert secret.read_secret_file(str(p), "x") == KEY.strip()
    p.chmod(0o600)
    p.write_bytes(b"k" * (secret.MAX_SECRET_BYTES + 1))
    with pytest.raises(ConfigError, match="holds at most"):
        secret.read_secret_file(str(p), "x")
    with pytest.raises(ConfigError, match="cannot read"):
        secret.read_secret_file(str(tmp_path / "missing"), "x")


def test_the_loader_accepts_the_directories_deployments_use(tmp_path: Path) -> None:
    """What a deployment does is accepted: a file in a sticky world-writable directory (/tmp:
    only its owner can rename it), and a path through a link of root or ours in a directory
    only they can change (Kubernetes' `..data` link of a secret volume)."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    assert secret.read_secret_file(str(_ours(sticky / "k", KEY)), "x") == KEY.strip()
    vol = tmp_path / "vol"
    (vol / "..2026_12_03").mkdir(parents=True)
    _ours(vol / "..2026_12_03" / "k", KEY)
    (vol / "..data").symlink_to("..2026_12_03")
    assert secret.read_secret_file(str(vol / "..data" / "k"), "x") == KEY.strip()
    rel = os.path.relpath(vol / "..data" / "k")
    assert secret.read_secret_file(rel, "x") == KEY.strip()


def test_the_loader_reads_without_proc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bare chroot has no /proc: the checked file is opened again by name, if it is still
    the inode that was checked (a name swapped in between is refused)."""
    real_open = os.open

    def no_proc(p: object, *a: object, **k: object) -> int:
        if str(p).startswith("/proc/self/fd/"):
            raise FileNotFoundError(2, "No such file or directory")
        return real_open(p, *a, **k)                       # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", no_proc)
    p = _ours(tmp_path / "k", KEY)
    assert secret.read_secret_file(str(p), "x") == KEY.strip()


def test_the_loader_refuses_what_is_not_a_file_on_disk() -> None:
    """/proc/self/environ is a private regular file of ours: our environment is not a secret."""
    with pytest.raises(ConfigError, match="not a file on disk"):
        secret.read_secret_file("/proc/self/environ", "x")


def test_the_loader_never_opens_a_fifo_or_device_for_reading(tmp_path: Path) -> None:
    """Opening a FIFO or a device has effects (a FIFO's writer is released; a watchdog, a tape
    rewinds): the loader checks the kind on an O_PATH descriptor and opens only a regular
    file. A writer blocked on the planted FIFO stays blocked."""
    import threading

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    released = threading.Event()

    def writer() -> None:
        fd = os.open(fifo, os.O_WRONLY)           # blocks until someone opens it to read
        released.set()
        os.close(fd)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    with pytest.raises(ConfigError, match="not a regular file"):
        secret.read_secret_file(str(fifo), "x")
    opened = released.wait(2.0)
    os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))   # release the writer ourselves
    t.join(30)
    assert not opened, "the loader opened the FIFO for reading"


# -- no other reader -------------------------------------------------------------------------

SETTING = re.compile(r"(secret|password|keys?|salt)_file$|^SECRET_ENV$")
READS = {"open", "read_text", "read_bytes", "load", "loads", "fdopen", "read"}


def _secret_settings() -> dict[str, set[str]]:
    """Every configuration field that names a secret or key file, per section (each must have
    a reader in READERS)."""
    import dataclasses

    return {section: {f.name for f in dataclasses.fields(c) if SETTING.search(f.name)}
            for section, c in (("redis", RedisConfig), ("agent", AgentConfig),
                               ("store", StoreConfig))}


def test_every_kind_of_secret_file_has_a_reader_under_test() -> None:
    covered = {name.split(": ")[-1].split(" ")[0] for name, _b, _f in READERS}
    kinds = {f"{section}.{name}" for section, names in _secret_settings().items() for name in names}
    assert kinds <= covered, kinds - covered


def test_every_reader_opens_the_file_in_the_loader_only(tmp_path: Path) -> None:
    """Each reader, traced by Python's audit hook: every open of the secret file happens in
    `offload/secret.py` (a reader that opened it itself would be a second loader)."""
    import sys

    seen: list[tuple[str, str]] = []
    watching: dict[str, str] = {}

    def hook(event: str, args: tuple) -> None:
        if event == "open" and watching and str(args[0]) == watching.get("path"):
            f = sys._getframe(1)            # the innermost frame of the package opened it
            while f is not None and not f.f_code.co_filename.startswith(str(REPO / "offload")):
                f = f.f_back
            seen.append((watching["reader"], f.f_code.co_filename if f else "?"))

    sys.addaudithook(hook)
    for name, body, read in READERS:
        p = tmp_path / name.replace(" ", "_").replace(":", "")
        p.write_bytes(body)
        p.chmod(0o600)
        watching.update(path=str(p), reader=name)
        try:
            read(str(p))
        finally:
            watching.clear()
        assert any(r == name for r, _f in seen), f"{name}: the file was never opened"
    loader = str(REPO / "offload" / "secret.py")
    assert [(r, f) for r, f in seen if f != loader] == []


def test_no_other_code_reads_a_secret_file() -> None:
    """A function that names a secret-file setting and opens or reads a file is a second
    loader: only `offload/secret.py` may be one. Every function that names one must hand
    it to the loader (`read_secret_file`, `read_private_file`, `load_secret`, `load_keys`)
    or only pass it on."""
    offenders = []
    for path in sorted((REPO / "offload").rglob("*.py")):
        if path == REPO / "offload" / "secret.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            names = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)} | \
                {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)} | \
                {n.arg for n in ast.walk(fn) if isinstance(n, ast.arg)}
            if not any(SETTING.search(n) for n in names):
                continue
            calls = {c.func.attr if isinstance(c.func, ast.Attribute) else
                     c.func.id if isinstance(c.func, ast.Name) else "" for c in ast.walk(fn)
                     if isinstance(c, ast.Call)}
            if calls & READS:
                offenders.append(f"{path.relative_to(REPO)}:{fn.lineno} {fn.name}")
    assert offenders == [], offenders
