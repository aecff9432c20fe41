"""`bench store --drives`: one store over several directories against their raw disks, in one run
(small sizes: figures are not asserted, only their shape and honesty about a shared device)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_store_over_drives(tmp_path: Path) -> None:
    dirs = [tmp_path / f"d{i}" for i in range(3)]
    for d in dirs:
        d.mkdir()
    r = subprocess.run([sys.executable, "-m", "offload.cli", "bench", "store", "--drives",
                        ",".join(map(str, dirs)), "--sizes", "256KiB", "--total", "8MiB",
                        "--repeat", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert [d["dir"] for d in out["drives"]] == [str(d) for d in dirs]
    assert out["devices"] == 1 and len(out["shared_device"]) == 1   # one disk: said so
    row = out["sizes"][0]
    assert row["put_gbps"] > 0 and row["cold_get_gbps"] > 0 and row["raw_all_read_gbps"] > 0
    assert abs(sum(row["drive_share"]) - 1) < 1e-6 and all(s > 0 for s in row["drive_share"])
    assert all(list(d.iterdir()) == [] for d in dirs)     # scratch removed


def test_bench_store_drives_bad_input(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "offload.cli", "bench", "store", "--drives",
                        f"{tmp_path},{tmp_path}/nope"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "nope" in r.stderr and "does not exist" in r.stderr
    r = subprocess.run([sys.executable, "-m", "offload.cli", "bench", "store", "--drives",
                        str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "two or more" in r.stderr
