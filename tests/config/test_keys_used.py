"""No accepted key is inert: every setting of the configuration reference is read somewhere in the
package outside offload/config/ (an attribute access `<obj>.<key>` on something other than
`self`, or `getattr(..., "<key>")`). A key that nothing reads is a defect: remove it (and list it
in `offload.config.REMOVED_KEYS`, so that a config still setting it gets a clear error)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from offload.config import REMOVED_KEYS, ConfigError, load_text, reference

PACKAGE = Path(__file__).resolve().parents[2] / "offload"


def _sources() -> str:
    return "\n".join(p.read_text() for p in sorted(PACKAGE.rglob("*.py"))
                     if (PACKAGE / "config") not in p.parents)


def is_read(leaf: str, text: str) -> bool:
    for m in re.finditer(rf"\b(\w+)\.{re.escape(leaf)}\b(?!\s*\()", text):
        if m.group(1) != "self":
            return True
    return re.search(rf"getattr\([^)]*[\"']{re.escape(leaf)}[\"']", text) is not None


@pytest.mark.parametrize("key", [row[0] for row in reference()])
def test_every_config_key_is_read_outside_config(key: str) -> None:
    leaf = key.rsplit(".", 1)[1]
    assert is_read(leaf, _sources()), f"{key} is accepted but nothing outside offload/config/ reads it"


def test_the_walk_catches_an_inert_key() -> None:
    """A key nothing reads is caught; `self.<key>` does not count as a read. (The former
    redis.directory is no example any more: the L3 events read a disk store's `directory`.)"""
    assert not is_read("inert_key", _sources() + "\nself.inert_key = 1\nself.inert_key()\n")
    assert is_read("inert_key", "self.x = cfg.inert_key")


@pytest.mark.parametrize("key", sorted(REMOVED_KEYS))
def test_a_removed_key_is_refused_with_the_reason(key: str) -> None:
    parts = key.split(".")
    yaml_text = "".join("  " * i + f"{p}:\n" for i, p in enumerate(parts[:-1]))
    yaml_text += "  " * (len(parts) - 1) + f"{parts[-1]}: false\n"
    with pytest.raises(ConfigError) as e:
        load_text(yaml_text)
    assert f"{key}: removed" in str(e.value)
    assert key not in [row[0] for row in reference()]


def test_redis_directory_says_sharing_is_planned() -> None:
    with pytest.raises(ConfigError, match="pod-wide sharing .* planned as its own capability"):
        load_text("offload:\n  redis:\n    url: redis://127.0.0.1:6379/0\n    directory: true\n")
