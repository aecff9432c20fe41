"""A host KV pool in SGLang's page_first layout and a client of the agent over it: `host_pool`,
`page` (the K and V buffers of one page), `keys`, `client`."""

from __future__ import annotations

import numpy as np

from offload.agent.client import AgentStore
from offload.keys import Namespace
from tests.agent.conftest import SECRET

PAGE_TOKENS, LAYERS, HEADS, DIM = 16, 4, 4, 64          # one page: 2 x 16 KiB (K and V)


def host_pool(pages: int, seed: int) -> np.ndarray:
    """A host KV pool in SGLang's page_first layout: [2 (K,V), tokens, layers, heads, dim]."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 1 << 16, size=(2, pages * PAGE_TOKENS, LAYERS, HEADS, DIM),
                        dtype=np.uint16)


def page(pool: np.ndarray, i: int) -> list[memoryview]:
    """The buffers of page i: its K slice and its V slice (each contiguous)."""
    sl = slice(i * PAGE_TOKENS, (i + 1) * PAGE_TOKENS)
    return [memoryview(pool[0, sl]).cast("B"), memoryview(pool[1, sl]).cast("B")]


NS = Namespace(model="m", dtype="bf16", layout="page_first", page_size=PAGE_TOKENS)


def keys(n: int, tag: str = "") -> list[bytes]:
    return [NS.key(f"{tag}page-{i}") for i in range(n)]


def client(agent, transport: str = "ucx", **kw) -> AgentStore:
    return AgentStore(agent.address, SECRET, transport=transport, timeout_s=kw.pop("timeout_s", 5),
                      reconnect_s=kw.pop("reconnect_s", 0.2), **kw)
