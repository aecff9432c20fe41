"""The gds path: refusal rules and the checksum here; real cuFile I/O on a GPU machine (gpu marker)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest

from offload.config import load_offload
from offload.errors import PathUnavailableError
from offload.store.base import SlotStore
from offload.store.memory.store import MemoryStore
from offload.store.tiered import TieredStore, WriteThrough
from offload.transfer.gds import GdsPath, gds_really_available, wsum64, wsum64_numpy
from tests.store.stores import open_store
from tests.transfer.standin import OnGpu, fake_kvikio


@dataclass
class FakeDecision:
    path: str
    gpu_direct: bool
    role: str = "host"


def test_checksum_same_on_torch_and_numpy_and_catches_corruption() -> None:
    torch = pytest.importorskip("torch")
    for n in (1, 7, 8, 4096, 100_003):
        data = np.random.default_rng(n).integers(0, 255, n, dtype=np.uint8)
        assert wsum64(torch.from_numpy(data.copy())) == wsum64_numpy(data)
    data = np.random.default_rng(0).integers(0, 255, 1 << 16, dtype=np.uint8)
    base = wsum64_numpy(data)
    flipped = data.copy()
    flipped[12345] ^= 1
    swapped = data.copy()
    swapped[0:8], swapped[8:16] = data[8:16], data[0:8]
    assert len({base, wsum64_numpy(flipped), wsum64_numpy(swapped),
                wsum64_numpy(data[:-1])}) == 4


def test_gds_only_when_detection_says_really_available() -> None:
    assert gds_really_available(FakeDecision("gds", True))[0]
    assert not gds_really_available(FakeDecision("gds", False))[0]    # compat only
    assert not gds_really_available(FakeDecision("cpu", False))[0]
    assert not gds_really_available(None)[0]
    cfg = load_offload({"transfer": {"path": "gds"}})
    with pytest.raises(PathUnavailableError, match="gds"):
        GdsPath.open(cfg, FakeDecision("cpu", False), store=MemoryStore())


def test_store_without_slots_is_refused() -> None:
    cfg = load_offload({"transfer": {"path": "gds"}})
    with pytest.raises(PathUnavailableError, match="reserve_slots"):   # slots, but in memory
        GdsPath.open(cfg, FakeDecision("gds", True), store=MemoryStore())
    no_slots = TieredStore(MemoryStore(), MemoryStore(), WriteThrough())
    assert not isinstance(no_slots, SlotStore)
    with pytest.raises(PathUnavailableError, match="reserve_slots"):
        GdsPath.open(cfg, FakeDecision("gds", True), store=no_slots)


def test_disk_store_has_the_file_slots_gds_needs(tmp_path) -> None:
    with open_store(tmp_path / "s", 1 << 24) as store:
        assert isinstance(store, SlotStore) and store.slot_medium == "file"


@pytest.mark.gpu
def test_gds_roundtrip_on_gpu(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU with CUDA")
    pytest.importorskip("kvikio", reason="kvikio (pip install 'sglang-offload[gds]')")
    store = open_store(tmp_path / "s", 1 << 30)
    assert isinstance(store, SlotStore) and store.slot_medium == "file"
    path = GdsPath(store)
    src = torch.randint(0, 255, (16, 4 << 20), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    keys = [i.to_bytes(32, "big") for i in range(16)]
    try:
        assert path.put_many(keys, [[src[i]] for i in range(16)]) == [True] * 16
        assert path.get_many(keys, [[dst[i]] for i in range(16)]) == [True] * 16
        assert torch.equal(src, dst)
        host = np.zeros(4 << 20, np.uint8)            # a gds-written block read on the CPU path
        assert store.get_many([keys[3]], [[host]]) == [True]
        assert np.array_equal(host, src[3].cpu().numpy())
    finally:
        path.close()


@pytest.mark.parametrize("drives", [1, 3], ids=["one-dir", "three-drives"])
def test_gds_path_moves_blocks_through_the_file_slots_with_a_cpu_cufile(tmp_path, monkeypatch,
                                                                       drives):
    """Through the file slots; with three drives (`offload.store.paths`), a cuFile per slab file
    of every drive."""
    torch = pytest.importorskip("torch")
    from offload.config import Size, StoreConfig

    fake_kvikio(monkeypatch)
    from offload.store.factory import open_disk

    dirs = tuple(str(tmp_path / f"nvme{i}") for i in range(drives))
    store = open_disk(StoreConfig(path=dirs[0], paths=dirs if drives > 1 else (),
                                  capacity=Size(1 << 26), min_free=Size(0)))
    path = GdsPath(store)
    n = 3 * 4096 + 11
    # with several drives, 12 keys: which drive a key goes to follows the directories' names
    # (rendezvous hashing over pytest's tmp paths), and 4 keys all land on one of 3 drives in
    # 1 run of 27 (seen in a full run); 12 keys on one drive: 1 in 177,147
    k = 4 if drives == 1 else 12
    src = [OnGpu(torch.randint(0, 255, (n,), dtype=torch.uint8)) for _ in range(k)]
    keys = [i.to_bytes(32, "big") for i in range(k)]
    if drives > 1:   # keys on every drive
        keys = [bytes([i]) * 32 for i in range(k)]
    try:
        assert path.put_many(keys, [[s] for s in src]) == [True] * k
        host = np.zeros(n, np.uint8)                      # written by "gds", read by the CPU
        assert store.get_many([keys[1]], [[host]]) == [True]
        assert np.array_equal(host, src[1].tensor.numpy())
        dst = [OnGpu(torch.zeros(n, dtype=torch.uint8)) for _ in range(k + 1)]
        absent = (99).to_bytes(32, "big")
        before = store.stats()
        assert path.get_many(keys + [absent], [[d] for d in dst]) == [True] * k + [False]
        assert all(torch.equal(s.tensor, d.tensor) for s, d in zip(src, dst))
        after = store.stats()
        assert (after.hits - before.hits, after.misses - before.misses) == (k, 1)
        used = {next(d for d in dirs if f.startswith(d + os.sep)) for f in path._files}
        assert len(used) >= min(drives, 2)      # cuFile handles on the slab files of each drive
    finally:
        path.close()
