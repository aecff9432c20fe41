"""Reading a machine's files under a root directory.

Primitive: `Root(path)`. Every probe reads `/sys`, `/proc`, `/dev`, `/etc`, ... through it, so a
test points the whole detection at a fixture tree (`tests/fixtures/hosts/<name>/`) and the live
machine is simply `Root("/")`. Paths given to its methods are *machine paths* (absolute, as seen by
the machine: `/sys/bus/pci/devices`); `realpath` resolves symlinks and returns a machine path again,
refusing to leave the root (fixture links must be relative). Reads never raise: a missing or
unreadable file is `None`.
"""

from __future__ import annotations

import os

from offload.errors import DetectError


class Root:
    """A machine's file tree rooted at `path` (`/` for the live machine)."""

    def __init__(self, path: str = "/") -> None:
        if not path:
            raise DetectError("the root directory is empty; give a directory such as / or a "
                              "fixture tree")
        if not os.path.isdir(path):
            raise DetectError(f"root {path!r} is not a directory (missing or not a folder)")
        if not os.access(path, os.R_OK | os.X_OK):
            raise DetectError(f"root {path!r} is not readable")
        self.path = os.path.realpath(path)
        self.live = self.path == "/"

    def host(self, machine_path: str) -> str:
        """The path on this process's file system for a machine path."""
        rel = machine_path.lstrip("/")
        return os.path.join(self.path, rel) if rel else self.path

    def read(self, machine_path: str) -> str | None:
        """Stripped text of a file, or None when it is missing or unreadable."""
        try:
            with open(self.host(machine_path), "rb") as f:
                data = f.read(1 << 20)
        except OSError:
            return None
        return data.decode("utf-8", "replace").strip()

    def read_int(self, machine_path: str, base: int = 10) -> int | None:
        text = self.read(machine_path)
        if text is None:
            return None
        try:
            return int(text.split()[0], base) if text else None
        except (ValueError, IndexError):
            return None

    def exists(self, machine_path: str) -> bool:
        return os.path.lexists(self.host(machine_path))

    def isdir(self, machine_path: str) -> bool:
        return os.path.isdir(self.host(machine_path))

    def listdir(self, machine_path: str) -> list[str]:
        """Sorted entries of a directory; [] when missing or unreadable."""
        try:
            return sorted(os.listdir(self.host(machine_path)))
        except OSError:
            return []

    def realpath(self, machine_path: str) -> str | None:
        """The machine path a chain of symlinks leads to; None if missing or outside the root."""
        host = self.host(machine_path)
        if not os.path.lexists(host):
            return None
        real = os.path.realpath(host)
        if self.live:
            return real
        if real != self.path and not real.startswith(self.path + os.sep):
            return None
        return "/" + os.path.relpath(real, self.path) if real != self.path else "/"
