"""Fixtures of the store tests: one way to open a disk store (`tests/store/stores.py`).

- `disk_store`: an empty `DiskStore` on `tmp_path/cache` (64 MiB), closed at teardown.
- `open_disk`: `open_disk(path=None, **kw)` opens a `DiskStore` as `stores.open_store` does
  (on `tmp_path/cache` by default); every store it opened is closed at teardown.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest

from offload.store.disk.store import DiskStore
from tests.store.stores import open_store


@pytest.fixture
def open_disk(tmp_path: Path) -> Iterator[Callable[..., DiskStore]]:
    opened: list[DiskStore] = []

    def _open(path: Path | str | None = None, **kw: object) -> DiskStore:
        s = open_store(tmp_path / "cache" if path is None else path, **kw)
        opened.append(s)
        return s

    yield _open
    for s in reversed(opened):
        s.close()


@pytest.fixture
def disk_store(open_disk: Callable[..., DiskStore]) -> DiskStore:
    return open_disk(capacity=64 << 20)
