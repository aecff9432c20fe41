"""Loading: a deployment file's text -> the checked tree; the file's own rules; overrides.

Primitives:
- `load_offload(data)`: the `offload:` tree from plain data, every problem at once in one
  `ConfigError` (strict keys and types by `build.py`, then ranges and combinations by `checks.py`).
- `load_text(text)` / `load_file(path)`: a whole deployment file (`offload:` and `sglang:`): YAML
  with no key given twice, no empty file, no keys that contradict each other; `load_file` reads at
  most `MAX_CONFIG_BYTES` of UTF-8 from a regular file, and a file holding a secret
  (`inline_secrets`) is read again by the one loader of secret files (`offload.secret`).
- `apply_overrides(cfg, {"store.path": value})`: precedence (CLI > environment > file > default)
  applied in one place, the result checked again.
"""

from __future__ import annotations

import difflib
import os
import stat
from pathlib import Path
from typing import Any, Mapping

from offload import redact
from offload.config.build import build
from offload.config.checks import check, unrelated
from offload.config.tree import DeploymentConfig, OffloadConfig, to_dict
from offload.errors import ConfigError


def load_offload(data: Any, path: str = "offload") -> OffloadConfig:
    """Validate the `offload:` tree. Raises ConfigError listing every problem (type and range
    problems of every key at once)."""
    problems: list[str] = []
    cfg = build(OffloadConfig, data, path, problems)
    checks: list[str] = []
    check(cfg, checks)
    bad_keys = {line.split(":", 1)[0] for line in problems}
    problems += [line for line in checks if unrelated(line, bad_keys)]
    if problems:
        raise ConfigError(problems)
    return cfg


def _yaml_problem(e: Exception) -> str:
    """The parser's problem and where, without the quoted source line (it may hold a secret)."""
    mark = getattr(e, "problem_mark", None)
    what = getattr(e, "problem", None) or type(e).__name__
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(e, "context", None)
    return redact.text(f"{what}{where}" + (f" ({context})" if context else ""))


def _strict_loader() -> Any:
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        pass

    def mapping(loader: Any, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, str) and key in seen:
                raise ConfigError([f"line {line}: key {key!r} is given twice (also line "
                                   f"{seen[key]}); YAML would keep only the last: keep one"])
            if isinstance(key, str):
                seen[key] = line
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return StrictLoader


def _conflicts(data: Mapping[str, Any]) -> list[str]:
    """Keys of the file that contradict each other (only the file says which were given)."""
    off = data.get("offload")
    store = off.get("store") if isinstance(off, Mapping) else None
    if isinstance(store, Mapping) and store.get("paths") and "path" in store:
        return ["offload.store.path: set together with paths, which replaces it (path would be "
                "ignored); delete path, or list that directory in paths"]
    return []


def load_text(text: str, source: str = "<config>") -> DeploymentConfig:
    """Parse and validate a deployment file's text. Refused, each with its own line: YAML
    errors, a key given twice in one mapping, a file with no settings (empty or comments only),
    keys that contradict each other (`store.path` with `store.paths`), and every key problem."""
    import yaml

    try:
        data = yaml.load(text, Loader=_strict_loader())   # noqa: S506 - a SafeLoader subclass
    except ConfigError as e:
        raise ConfigError([f"{source}: {e.problems[0]}"]) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"{source}: not valid YAML: {_yaml_problem(e)}"]) from None
    if data is None:
        raise ConfigError([f"{source}: holds no settings (empty, or comments only); a deployment "
                           "file has an offload: and/or a sglang: section (configs/ has examples)"])
    if not isinstance(data, Mapping):
        raise ConfigError([f"{source}: the top level must be a mapping with offload: and/or "
                           "sglang: sections"])
    problems: list[str] = []
    for key in data:
        if key not in ("offload", "sglang"):
            close = difflib.get_close_matches(str(key), ["offload", "sglang"], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"{key}: unknown top-level section{hint}; allowed: offload, sglang")
    sglang = data.get("sglang") or {}
    if not isinstance(sglang, Mapping):
        problems.append(f"sglang: expected a mapping of SGLang server arguments, got {sglang!r}")
        sglang = {}
    problems += _conflicts(data)
    try:
        offload = load_offload(data.get("offload"))
    except ConfigError as e:
        problems.extend(e.problems)
        offload = OffloadConfig()
    if problems:
        raise ConfigError(problems)
    return DeploymentConfig(offload=offload, sglang=dict(sglang))


MAX_CONFIG_BYTES = 4 << 20


def inline_secrets(dep: DeploymentConfig) -> list[str]:
    """The keys of `dep` whose values are secrets written in the file itself (not in a file of
    their own): the tenant salt, a Redis URL with a password, SGLang's secret flags."""
    found = ["offload.store.salt"] if dep.offload.store.salt else []
    url = dep.offload.redis.url
    if url and (redact.url(url) != url):
        found.append("offload.redis.url")
    found += [f"sglang.{k}" for k, v in dep.sglang.items()
              if str(k).replace("-", "_") in redact.SGLANG_SECRET_KEYS and v not in (None, "")]
    return found


def _reread_private(path: Path, raw: bytes, dep: DeploymentConfig) -> None:
    """A file holding a secret must be the service user's own private file: read again by the
    one loader of secret files (`offload.secret.read_private_file`: owned by the effective uid,
    no group/other bits, not a symbolic link, one name, in directories only root and the
    service user can change), which must see the very bytes parsed."""
    secrets = inline_secrets(dep)
    if not secrets:
        return
    from offload.secret import read_private_file

    why = (f" (the file holds the secret {', '.join(secrets)}; or move it to a file of its own: "
           "offload.store.salt_file, offload.redis.password_file)")
    try:
        again = read_private_file(str(path), secrets[0], MAX_CONFIG_BYTES)
    except ConfigError as e:
        raise ConfigError([e.problems[0] + why]) from None
    if again != raw:
        raise ConfigError([f"{secrets[0]}: {path} changed while it was read; read it again"
                           + why])


def load_file(path: str | Path) -> DeploymentConfig:
    """`load_text` of a file (UTF-8, at most 4 MiB); a file whose settings hold a secret
    (`inline_secrets`) must be the service user's own private file, as a secret file must
    (`_reread_private`)."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as e:
        raise ConfigError([f"{p}: cannot read the config file: {e.strerror or e}"]) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):   # a FIFO would block the read for good
            raise ConfigError([f"{p}: not a regular file; name the config file itself"])
        raw = b""
        while len(raw) <= MAX_CONFIG_BYTES:
            chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - len(raw))
            if not chunk:
                break
            raw += chunk
    except OSError as e:
        raise ConfigError([f"{p}: cannot read the config file: {e.strerror or e}"]) from None
    finally:
        os.close(fd)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError([f"{p}: larger than {MAX_CONFIG_BYTES >> 20} MiB; not a config file"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([f"{p}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                           "save the config file as UTF-8"]) from None
    dep = load_text(text, str(p))
    _reread_private(p, raw, dep)
    return dep


def apply_overrides(cfg: OffloadConfig, overrides: Mapping[str, Any]) -> OffloadConfig:
    """Return cfg with dotted-key overrides (`store.path`: value) applied and re-validated."""
    tree = to_dict(cfg)
    for dotted, value in overrides.items():
        if value is None:
            continue
        node = tree
        parts = dotted.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return load_offload(tree)
