"""Deterministic test blocks: the bytes of a block follow from its key, so any process can check them."""

from __future__ import annotations

import hashlib

from offload.keys import Namespace

NS = Namespace(model="tiny", dtype="bfloat16", layout="page_first", page_size=16)


def key(i: int, ns: Namespace = NS) -> bytes:
    return ns.key(f"page-{i}")


def data(k: bytes, size: int) -> bytes:
    seed = hashlib.blake2b(k, digest_size=64).digest()
    return (seed * (size // 64 + 1))[:size]
