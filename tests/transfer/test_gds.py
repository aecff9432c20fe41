"""The gds path: refusal rules and the checksum here; real cuFile I/O on a GPU machine (gpu marker)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from offload.config import load_offload
from offload.errors import PathUnavailableError
from offload.store.memory import MemoryStore
from offload.transfer.gds import GdsPath, gds_really_available, wsum64, wsum64_numpy


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
    with pytest.raises(PathUnavailableError, match="reserve_slots"):
        GdsPath.open(cfg, FakeDecision("gds", True), store=MemoryStore())


@pytest.mark.gpu
def test_gds_roundtrip_on_gpu(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU with CUDA")
    pytest.importorskip("kvikio", reason="kvikio (pip install 'sglang-offload[gds]')")
    from offload.config import Size, StoreConfig
    from offload.store.disk import DiskStore

    store = DiskStore(StoreConfig(path=str(tmp_path / "s"), capacity=Size(1 << 30),
                                  min_free=Size(0)))
    if not hasattr(store, "reserve_slots"):
        pytest.skip("DiskStore does not expose reserve_slots/commit_slots/locate_many yet")
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
