"""The backend's settings from SGLang's extra config (control path).

- `settings_from_extra(extra)`: the `offload:` tree from `--hicache-storage-backend-extra-config`
  (a deployment YAML named by `config_file` as the base, the inline `offload` tree over it);
  unknown keys are errors naming them, SGLang's own keys (`contract.SGLANG_KEYS`) are left alone.
- `resolve_salt(cfg)`: `store.salt` read from `store.salt_file` by the one secret-file loader.
Both raise `ConfigError` naming every bad key; each scheduler process reads them at construction.
"""

from __future__ import annotations

import dataclasses

from offload.config import OffloadConfig, load_file, load_offload, to_dict
from offload.errors import ConfigError
from offload.hicache.contract import EXTRA_KEYS, SGLANG_KEYS


def settings_from_extra(extra: dict | None) -> OffloadConfig:
    """The `offload:` settings from SGLang's extra config.

    `config_file` (a deployment YAML; its `offload:` section) is the base, and the inline
    `offload` tree overrides keys of it; `store.salt_file` is read into `store.salt`. Raises
    ConfigError naming every bad key (or an unreadable / non-private salt file).
    """
    extra = dict(extra or {})
    problems = []
    for key in extra:
        if key not in EXTRA_KEYS and key not in SGLANG_KEYS:
            problems.append(f"hicache-storage-backend-extra-config.{key}: unknown key; allowed: "
                            + ", ".join(EXTRA_KEYS))
    inline = extra.get("offload")
    if inline is not None and not isinstance(inline, dict):
        problems.append("hicache-storage-backend-extra-config.offload: expected a mapping (the "
                        f"YAML offload: section), got {type(inline).__name__}")
    path = extra.get("config_file")
    if path is not None and not isinstance(path, str):
        problems.append(f"hicache-storage-backend-extra-config.config_file: {path!r} is not a path")
    if problems:
        raise ConfigError(problems)
    tree: dict = to_dict(load_file(path).offload) if path else {}
    return resolve_salt(load_offload(_merge(tree, inline or {})))   # store.salt_file read here


def resolve_salt(cfg: OffloadConfig) -> OffloadConfig:
    """`cfg` with `store.salt` read from `store.salt_file` (mode 600, by the one secret-file
    loader) when that is set. Raises ConfigError naming the file."""
    if not cfg.store.salt_file:
        return cfg
    from offload.secret import read_secret_file

    salt = read_secret_file(cfg.store.salt_file, "offload.store.salt_file", min_bytes=1)
    store = dataclasses.replace(cfg.store, salt=salt.decode("utf-8", "replace"), salt_file=None)
    return dataclasses.replace(cfg, store=store)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
