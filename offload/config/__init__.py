"""One validated configuration tree.

Primitives: frozen dataclasses (`OffloadConfig` and its sections) built by `load_offload(dict)`,
`load_file(path)` and `load_text(str)`. Every problem found is reported at once as a `ConfigError`
whose lines name the YAML key path, the bad value and what is allowed. Unknown keys are errors.
Sizes accept plain bytes or a number with a unit (`512MiB`, `2TiB`, `1.5GB`).

`parse_url(url)` -> `RedisTarget`: the grammar of `offload.redis.url` (standalone or cluster, TLS or
not, nodes, db, credentials), checked with the rest of the tree.

Precedence (CLI > environment > file > default) is applied in one place: `apply_overrides`.

One role per module, each importing only those above it in this list (no cycle):
- `values`: the size grammar (`Size`, `format_size`), `OnOffAuto`, how a type is named to the user;
- `tree`: the sections' dataclasses with each key's default and doc, `to_dict`;
- `redis_url`: the Redis URL grammar (`parse_url`, `RedisTarget`), below every tier;
- `build`: plain data -> the tree, strict keys and types, `REMOVED_KEYS`;
- `checks`: ranges and combinations, one function per section;
- `load`: YAML files and text, secrets in a file, overrides;
- `reference`: the generated docs/reference/config.md table.

Callers import from `offload.config`; the names below are the whole public surface.
"""

from __future__ import annotations

from offload.config.build import REMOVED_KEYS
from offload.config.load import (
    MAX_CONFIG_BYTES,
    apply_overrides,
    inline_secrets,
    load_file,
    load_offload,
    load_text,
)
from offload.config.redis_url import RedisTarget, parse_url
from offload.config.reference import reference
from offload.config.tree import (
    AgentConfig,
    AgentLimitsConfig,
    DeploymentConfig,
    HwConfig,
    MetricsConfig,
    OffloadConfig,
    RedisConfig,
    StoreConfig,
    TransferConfig,
    WorthItConfig,
    to_dict,
)
from offload.config.values import OnOffAuto, Size, format_size
from offload.errors import ConfigError

__all__ = [
    "MAX_CONFIG_BYTES", "REMOVED_KEYS", "AgentConfig", "AgentLimitsConfig", "ConfigError",
    "DeploymentConfig", "HwConfig", "MetricsConfig", "OffloadConfig", "OnOffAuto", "RedisConfig",
    "RedisTarget", "Size", "StoreConfig", "TransferConfig", "WorthItConfig", "apply_overrides",
    "format_size", "inline_secrets", "load_file", "load_offload", "load_text", "parse_url",
    "reference", "to_dict",
]
