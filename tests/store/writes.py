"""Blocks of 64 KiB put (not flushed) and read back exactly by id: the write-path and range tests."""

from __future__ import annotations

from tests.store.blocks import data, key

SIZE = 64 << 10


def put(s, ids, size=SIZE) -> list[bool]:
    ks = [key(i) for i in ids]
    return s.put_many(ks, [[data(k, size)] for k in ks])


def exact(s, ids, size=SIZE) -> bool:
    bufs = [bytearray(size) for _ in ids]
    ok = s.get_many([key(i) for i in ids], [[b] for b in bufs])
    return all(ok) and all(bytes(b) == data(key(i), size) for i, b in zip(ids, bufs))
