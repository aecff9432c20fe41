"""Keeping secrets off SGLang's command line: the settings file `launch` hands SGLang, and redaction.

The offload settings hold secrets (the tenant salt, a Redis password inside the URL). A command
line is readable by every local user (`/proc/PID/cmdline`, `ps`) and SGLang logs its server
arguments, so `launch` writes the effective `offload:` tree to a file and passes only the file's
path (`config_file` in the backend's extra config; the backend loads it in each scheduler).

Primitives:
- `runtime_dir(env)`: the private directory for these files: `$XDG_RUNTIME_DIR/sglang-offload`
  when that variable names a directory of ours, else `<tmp>/sglang-offload-<uid>`. Created 0700;
  an existing one that is a symlink, not ours, or open to group/others is refused (`ConfigError`
  naming the path and the fix), as ssh refuses a loose ~/.ssh.
- `settings_path(dir, pid)`: `dir/launch-<pid>.yaml` (pid: the process that execs SGLang, so
  SGLang's own pid). Pure: `--dry-run` shows it without creating anything.
- `write_settings(path, tree)`: the file, mode 0600, created with O_EXCL | O_NOFOLLOW under a
  temporary name and renamed into place; files left by launches whose process is gone are
  removed first.
- `redact(tree)`: a copy for display with the salt and URL passwords replaced by `***`
  (`offload.redact`, the one redaction path).
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any, Mapping

import yaml

from offload import redact as _redact
from offload.errors import ConfigError

RUNTIME_ENV = "XDG_RUNTIME_DIR"     # the per-user runtime directory (systemd/pam); optional
REDACTED = _redact.MASK


def runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    """The private directory for launch's settings files, created 0700 if missing.

    Raises:
        ConfigError: the directory exists but is a symlink, not a directory, not owned by this
            user, or open to group/others; or it cannot be created.
    """
    env = os.environ if env is None else env
    base = env.get(RUNTIME_ENV, "")
    if base and os.path.isdir(base) and os.stat(base).st_uid == os.getuid():
        d = Path(base) / "sglang-offload"
    else:
        d = Path(tempfile.gettempdir()) / f"sglang-offload-{os.getuid()}"
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError([f"launch: cannot create the runtime directory {d}: "
                           f"{e.strerror or e}"]) from None
    st = os.lstat(d)
    fix = f"remove it (`rm -rf {d}`) or set ${RUNTIME_ENV} to a private directory"
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError([f"launch: runtime directory {d} is not a directory (a symlink?); {fix}"])
    if st.st_uid != os.getuid():
        raise ConfigError([f"launch: runtime directory {d} belongs to uid {st.st_uid}, not to "
                           f"this user ({os.getuid()}); {fix}"])
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError([f"launch: runtime directory {d} has mode "
                           f"{stat.S_IMODE(st.st_mode):o}; run `chmod 700 {d}`"])
    return d


def settings_path(directory: Path, pid: int | None = None) -> Path:
    return directory / f"launch-{os.getpid() if pid is None else pid}.yaml"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_settings(path: Path, tree: Mapping[str, Any]) -> None:
    """Write `{offload: tree}` to `path` (mode 0600) in a directory from `runtime_dir`."""
    for old in path.parent.glob("launch-*.yaml"):
        m = re.fullmatch(r"launch-([0-9]+)\.yaml", old.name)
        if m and old != path and not _alive(int(m.group(1))):
            old.unlink(missing_ok=True)
    text = yaml.safe_dump({"offload": dict(tree)}, sort_keys=False)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def redact_url(url: str | None) -> str | None:
    return _redact.url(url) if url else url


def redact(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of an `offload:` tree fit to print: salt and URL passwords replaced (the one
    redaction path, `offload.redact`)."""
    return _redact.tree("offload", tree)
