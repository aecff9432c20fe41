"""The process a power cut hits: first verifies what earlier rounds acknowledged, then writes until killed.

    python tests/powerloss/writer.py '<json>'

Options: `mode` — `disk` (a `DiskStore` on `dir`), `sglang` (our `OffloadStorage` built by SGLang's own
backend factory over a real SGLang host KV pool, as tests/hicache does), `agent` (an `AgentStore`
client of the agent at `address`, whose `DiskStore` lives on the file system under test);
`acked` (a file of page names acknowledged before, one per line), `tag` (this round: new names),
`write` (false: verify only).

Output, one line each, flushed: `VERIFIED {"checked": n, "lost": [...], "wrong": [...]}` (lost: a miss;
wrong: served with other bytes), then `ACK <name>` for every page a call reported stored, printed right
after that call returned. Page bytes are a function of the page name, so any process can check them.
"""

from __future__ import annotations

import json
import os
import random
import sys
import zlib
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from offload.store.base import durable  # noqa: E402

SIZES = (16 << 10, (48 << 10) + 100, 128 << 10)   # several slot sizes, one not 4 KiB-aligned
SEGMENT = "1MiB"                                  # small slabs: new slab files all the time
BATCH = 512                                       # names checked per call when verifying


def page_data(name: str) -> bytes:
    import numpy as np

    i = int(name.rsplit("-", 1)[1])
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return rng.integers(0, 256, SIZES[i % len(SIZES)], dtype=np.uint8).tobytes()


def flush(store: Any) -> bool:
    """A put returns once written; the disk store makes it durable and visible in the background
    (group commit): acknowledge only what is durable (`durable`; here `flush`: False, a block
    was lost)."""
    done = getattr(store, "flush", None)
    return done is None or done() is not False


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class BlockWriter:
    """`disk` and `agent` modes: any `BlockStore`, blocks named `<tag>-<i>`."""

    def __init__(self, store: Any):
        from offload.keys import Namespace

        self.store = store
        self.ns = Namespace(model="powerloss", dtype="u8", layout="blocks", page_size=1)

    def verify(self, names: list[str]) -> tuple[list[str], list[str]]:
        lost, wrong = [], []
        for at in range(0, len(names), BATCH):
            chunk = names[at:at + BATCH]
            want = [page_data(n) for n in chunk]
            dests = [bytearray(len(w)) for w in want]
            ok = self.store.get_many([self.ns.key(n) for n in chunk], [[d] for d in dests])
            for n, good, d, w in zip(chunk, ok, dests, want):
                if not good:
                    lost.append(n)
                elif bytes(d) != w:
                    wrong.append(n)
        return lost, wrong

    def write(self, tag: str, rng: random.Random) -> None:
        i = 0
        while i < 100_000:
            names = [f"{tag}-{j}" for j in range(i, i + rng.randint(1, 6))]
            i += len(names)
            keys = [self.ns.key(n) for n in names]
            ok = durable(self.store, keys, self.store.put_many(keys, [[page_data(n)] for n in names]))
            for n, good in zip(names, ok):
                if good:
                    say(f"ACK {n}")


class SGLangWriter:
    """`sglang` mode: pages of prompt `seed` named `<seed>-<page>`, stored from host pages 0..n-1."""

    def __init__(self, directory: str):
        from tests.hicache import hicache_pools as hp

        self.hp = hp
        self.host = hp.host_pool(hp.device_pool(), "page_first", pages=24)
        extra = hp.extra(directory, store={"segment_size": SEGMENT})
        self.backend = hp.make_backend(hp.storage_config(extra), self.host)

    @staticmethod
    def _key(seed: int, page: int) -> str:
        return f"{seed:08x}{page:056x}"    # tests/hicache/worker.py's prompt keys

    def verify(self, names: list[str]) -> tuple[list[str], list[str]]:
        import torch

        hp, P = self.hp, self.hp.PAGE
        by_seed: dict[int, list[int]] = {}
        for n in names:
            seed_text, page_text = n.split("-")
            by_seed.setdefault(int(seed_text), []).append(int(page_text))
        lost, wrong = [], []
        for seed, pages in by_seed.items():
            for at in range(0, len(pages), 8):
                chunk = pages[at:at + 8]
                hp.fill(self.host, seed + 1)              # scribble, then load into pages 8..
                ok = self.backend.batch_get_v1([self._key(seed, p) for p in chunk],
                                               torch.arange(8 * P, (8 + len(chunk)) * P))
                got = [hp.page_bytes(self.host, (8 + k) * P) for k in range(len(chunk))]
                hp.fill(self.host, seed)
                for p, good, g in zip(chunk, ok, got):
                    if not good:
                        lost.append(f"{seed}-{p}")
                    elif g != hp.page_bytes(self.host, p * P):
                        wrong.append(f"{seed}-{p}")
        return lost, wrong

    def write(self, tag: str, rng: random.Random) -> None:
        import torch

        P = self.hp.PAGE
        for seed in range(int(tag) * 1000, int(tag) * 1000 + 1000):
            self.hp.fill(self.host, seed)
            n = rng.randint(1, 8)
            ok = self.backend.batch_set_v1([self._key(seed, p) for p in range(n)],
                                           torch.arange(0, n * P))
            stored = flush(self.backend.store)
            for p, good in enumerate(ok):
                if good and stored:
                    say(f"ACK {seed}-{p}")


def open_writer(opts: dict) -> BlockWriter | SGLangWriter:
    mode = opts["mode"]
    if mode == "sglang":
        return SGLangWriter(opts["dir"])
    if mode == "agent":
        from offload.agent.client import AgentStore

        secret = os.environ["SGLANG_OFFLOAD_SECRET"].encode()
        return BlockWriter(AgentStore(opts["address"], secret, transport="tcp", timeout_s=20))
    from offload.config import Size, StoreConfig
    from offload.store.disk.store import DiskStore

    cfg = StoreConfig(path=opts["dir"], capacity=Size(1 << 30), min_free=Size(0),
                      segment_size=Size(1 << 20), o_direct=opts.get("o_direct", "auto"))
    return BlockWriter(DiskStore(cfg))


def run(opts: dict, emit: Callable[[str], None] = say) -> None:
    writer = open_writer(opts)
    names = []
    if opts.get("acked"):
        with open(opts["acked"]) as f:
            names = [line.strip() for line in f if line.strip()]
    lost, wrong = writer.verify(names)
    emit("VERIFIED " + json.dumps({"checked": len(names), "lost": lost, "wrong": wrong}))
    if opts.get("write", True):
        writer.write(str(opts["tag"]), random.Random(opts["tag"]))


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
