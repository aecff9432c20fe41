"""The drive set: which NVMe drives the cache would use and why, how the configured directories
sit on them, and their combined read bandwidth (fixture machines dgx-8nvme, h100-md-raid0)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from offload.cli import main
from offload.config import load_offload
from offload.hw import decide, detect
from offload.hw.decide import gds_checks
from offload.hw.drive_set import DriveSet, choose_drives
from offload.hw.facts import Drive, Facts
from offload.hw.storage import pcie_link
from tests.hw.hw_schema_check import validate

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
HOSTS = FIXTURES / "hosts"
SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "offload/hw/schema.json").read_text())
ALL_CU13 = str(FIXTURES / "pythons" / "all-cu13")
DGX_PATHS = ["/data1/kv", "/data4/kv", "/mnt/kv4/kv", "/data6/kv", "/scratch/kv"]


def drive_set(machine: str, cfg: dict, env: dict | None = None) -> DriveSet:
    config = load_offload(cfg)
    return choose_drives(detect(config, root=str(HOSTS / machine), env=env or {}), config)


def uses(ds: DriveSet) -> dict[str, str]:
    return {u.device: ("yes: " if u.use else "no: ") + u.reason for u in ds.drives}


def test_dgx_drive_set_and_every_reason() -> None:
    ds = drive_set("dgx-8nvme", {})
    got = uses(ds)
    assert got == {
        "nvme0n1p1": "no: holds the root file system (/)",
        "nvme0n1p2": "no: shares nvme0n1 with the root file system (/)",
        "nvme1n1": "yes: xfs at /data1, NUMA node 0, on nvme1",
        "nvme2n1": "yes: xfs at /data2, NUMA node 0, on nvme2",
        "nvme3n1": "no: mounted read-only at /data3",
        "nvme4n1": "yes: xfs at /data4, NUMA node 1, on nvme4",
        "nvme5n1": "yes: ext4 at /data5, NUMA node 1, on nvme5",
        "nvme6n1": "no: btrfs at /data6: the cache wants ext4 or xfs (O_DIRECT, GDS)",
        "nvme7n1": "no: no file system mounted from it (make one: mkfs.xfs /dev/nvme7n1, and "
                   "mount it)",
    }
    assert ds.gpu_nodes == (0, 1) and "every GPU" in ds.gpu_nodes_reason
    assert ds.suggestion == ("/data1/sglang-offload", "/data2/sglang-offload",
                             "/data4/sglang-offload", "/data5/sglang-offload")
    assert "4 drives (nvme1n1, nvme2n1, nvme4n1, nvme5n1), ~31.5 GB/s combined" in \
        ds.suggestion_reason
    (d,) = ds.directories
    assert d.key == "offload.store.path" and d.device == "nvme0n1p1"
    assert "holds the root file system" in d.warnings[0]


@pytest.mark.parametrize("cfg,env,nodes,chosen", [
    ({}, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, (0,), ["nvme1n1", "nvme2n1"]),
    ({}, {"CUDA_VISIBLE_DEVICES": "4,5"}, (1,), ["nvme4n1", "nvme5n1"]),
    ({"transfer": {"numa_node": 1}}, {}, (1,), ["nvme4n1", "nvme5n1"]),
    ({}, {"CUDA_VISIBLE_DEVICES": "GPU-5e2c"}, (0, 1),
     ["nvme1n1", "nvme2n1", "nvme4n1", "nvme5n1"]),
])
def test_drives_on_another_socket_than_the_servers_gpus_are_skipped(
        cfg: dict, env: dict, nodes: tuple[int, ...], chosen: list[str]) -> None:
    ds = drive_set("dgx-8nvme", cfg, env)
    assert ds.gpu_nodes == nodes
    assert [u.device for u in ds.chosen] == chosen
    other = [u for u in ds.drives if "another socket" in u.reason]
    assert len(other) == (4 - len(chosen) if len(chosen) < 4 else 0)
    for u in other:
        assert "its reads would cross the socket link" in u.reason


def test_configured_paths_are_judged_and_shared_devices_count_once() -> None:
    ds = drive_set("dgx-8nvme", {"store": {"paths": DGX_PATHS}})
    by_key = {d.key: d for d in ds.directories}
    assert [d.device for d in ds.directories] == ["nvme1n1", "nvme4n1", "nvme4n1", "nvme6n1",
                                                  "nvme0n1p2"]
    assert by_key["offload.store.paths[0]"].warnings == ()
    assert "offload.store.paths[1] /data4/kv and offload.store.paths[2] /mnt/kv4/kv are on one " \
           "device (nvme4n1): they share its bandwidth" in by_key["offload.store.paths[1]"].warnings[0]
    assert "btrfs" in by_key["offload.store.paths[3]"].warnings[0]
    assert "shares nvme0n1 with the root file system" in \
        by_key["offload.store.paths[4]"].warnings[0]
    assert ds.suggestion == ()               # paths is set: no suggestion
    # five directories, four distinct devices: the bind mount counts once
    assert ds.read_gbps == pytest.approx(4 * 7.88)
    assert ds.bandwidth.startswith("4 drives (nvme1n1, nvme4n1, nvme6n1, nvme0n1p2), ~31.5 GB/s "
                                   "combined")
    assert "directories sharing a device count once" in ds.bandwidth


def test_md_raid0_is_one_device_over_two_drives() -> None:
    ds = drive_set("h100-md-raid0", {})
    assert uses(ds) == {
        "nvme0n1p1": "no: holds the root file system (/)",
        "md0": "yes: xfs at /raid, NUMA node 0, on nvme1, nvme2",
        "nvme3n1": "no: no file system mounted from it (make one: mkfs.xfs /dev/nvme3n1, and "
                   "mount it)",
    }
    assert ds.suggestion == ("/raid/sglang-offload",)
    assert "2 drives (md0 over nvme1n1, nvme2n1), ~31.5 GB/s combined" in ds.suggestion_reason
    assert ds.bandwidth == "1 drive (nvme0n1p1), ~3.94 GB/s (its PCIe link ceiling)"
    two = drive_set("h100-md-raid0", {"store": {"paths": ["/raid/a", "/raid/b"]}})
    assert two.read_gbps == pytest.approx(2 * 15.75)
    assert "are on one device (md0)" in two.warnings[0]


def test_md_members_say_what_holds_them() -> None:
    facts = detect(load_offload({}), root=str(HOSTS / "h100-md-raid0"))
    md = next(d for d in facts.drives if d.device == "md0")
    assert (md.disks, md.nvme, md.numa_nodes, md.fs_type) == (
        ("nvme1n1", "nvme2n1"), ("nvme1", "nvme2"), (0,), "xfs")
    assert md.size_bytes == 15360 * 10**9 and md.free_bytes is None and not md.read_only
    assert [n.link for n in facts.nvme] == ["Gen3 x4", "Gen5 x4", "Gen5 x4", "Gen5 x4"]


def test_container_root_and_a_bind_mounted_drive() -> None:
    ds = drive_set("h100-gds-overlay", {})
    (d,) = ds.directories
    assert d.device is None and "system's / file system (overlay at /)" in d.warnings[0]
    assert ds.suggestion == ("/data/sglang-offload",)
    assert ds.bandwidth == "not on NVMe: no drive figure"
    config = load_offload({})
    d = decide(detect(config, root=str(HOSTS / "h100-gds-overlay")), config)
    (store,) = [r for r in d.reasons if r.startswith("store:")]
    assert store.endswith(" (not on NVMe: no drive figure)") and " on not on" not in store


def test_three_directories_on_one_device_are_listed_as_a_sentence() -> None:
    paths = ["/data4/kv", "/mnt/kv4/kv", "/data4/kv2"]
    ds = drive_set("dgx-8nvme", {"store": {"paths": paths}})
    assert ("offload.store.paths[0] /data4/kv, offload.store.paths[1] /mnt/kv4/kv and "
            "offload.store.paths[2] /data4/kv2 are on one device") in ds.directories[0].warnings[-1]


@pytest.mark.parametrize("speed,width,label,gbps", [
    ("16.0 GT/s PCIe", 4, "Gen4 x4", 7.88), ("32.0 GT/s PCIe", 4, "Gen5 x4", 15.75),
    ("8.0 GT/s PCIe", 2, "Gen3 x2", 1.97), ("5.0 GT/s PCIe", 4, "Gen2 x4", 2.0),
    ("Unknown", 4, None, None), ("16.0 GT/s PCIe", 0, None, None), (None, None, None, None),
])
def test_pcie_link(speed: str | None, width: int | None, label: str | None,
                   gbps: float | None) -> None:
    assert pcie_link(speed, width) == (label, gbps)


def test_decision_names_the_store_and_its_combined_bandwidth() -> None:
    config = load_offload({"store": {"paths": ["/data1/kv", "/data2/kv", "/data4/kv",
                                               "/data5/kv"]}})
    d = decide(detect(config, root=str(HOSTS / "dgx-8nvme")), config)
    store = [r for r in d.reasons if r.startswith("store:")]
    assert store == ["store: 4 directories on 4 drives (nvme1n1, nvme2n1, nvme4n1, nvme5n1), "
                     "~31.5 GB/s combined (sum of their PCIe link ceilings)"]


def test_gds_cache_fs_holds_for_every_directory() -> None:
    config = load_offload({"store": {"paths": ["/data/kv", "/dev/shm/kv"]}})
    facts = detect(config, root=str(HOSTS / "h100-gds-overlay"))
    check = next(c for c in gds_checks(facts) if c.name == "cache_fs")
    assert check.ok is False and "/dev/shm/kv is on tmpfs" in check.detail


def test_cli_reports_the_drive_set(capsys, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("offload:\n  store:\n    paths: [/data1/kv, /data4/kv, /mnt/kv4/kv]\n")
    rc = main(["detect", "--root", str(HOSTS / "dgx-8nvme"), "--config", str(cfg),
               "--python", ALL_CU13])
    cap = capsys.readouterr()
    assert rc == 0
    for part in ("Drives: 9, 4 for the cache", "nvme7n1    nvme7  1     -", "Cache directories: 3",
                 "offload.store.paths[2]: /mnt/kv4/kv",
                 "read bandwidth: 2 drives (nvme1n1, nvme4n1), ~15.8 GB/s combined"):
        assert part in cap.out, part
    assert "warning: offload.store.paths[1] /data4/kv and offload.store.paths[2]" in cap.err
    rc = main(["detect", "--root", str(HOSTS / "dgx-8nvme"), "--config", str(cfg), "--json",
               "--python", ALL_CU13])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and validate(out, SCHEMA) == []
    assert out["drive_set"]["chosen"] == ["/data1/sglang-offload", "/data2/sglang-offload",
                                          "/data4/sglang-offload", "/data5/sglang-offload"]
    assert len(out["facts"]["cache_dirs"]) == 3 and len(out["drive_set"]["warnings"]) == 1


def _with_drives(*drives: Drive) -> Facts:
    base = detect(load_offload({}), root=str(HOSTS / "cpu-box"))
    return dataclasses.replace(base, drives=base.drives + drives)


def _drive(device: str, points: tuple[str, ...], fs: str = "xfs", opts: str = "rw") -> Drive:
    return Drive(device=device, dev="259:9", disks=(device,), nvme=("nvme5",), numa_nodes=(0,),
                 size_bytes=None, fs_type=fs, mount_points=points, mount_options=opts,
                 read_only=False, free_bytes=None, source="test", reason="test")


def test_boot_usr_and_journalled_ext4_are_skipped() -> None:
    facts = _with_drives(_drive("nvme5n1", ("/boot/efi",), "vfat"), _drive("nvme6n1", ("/usr",)),
                         _drive("nvme7n1", ("/kv",), "ext4", "rw,data=journal"),
                         _drive("nvme8n1", ("/kv2",), "ext4", "rw,data=ordered"))
    got = uses(choose_drives(facts, load_offload({})))
    assert got["nvme5n1"] == "no: holds /boot/efi" and got["nvme6n1"] == "no: holds /usr"
    assert got["nvme7n1"].startswith("no: ext4 with data=journal at /kv: no O_DIRECT")
    assert got["nvme8n1"].startswith("yes: ext4 at /kv2")


def test_an_md_that_is_not_mounted_and_swap_are_named(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("build_hosts", FIXTURES / "build_hosts.py")
    assert spec and spec.loader
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)
    h = b.Host("md-unmounted")
    b._host_bridge(h, "00", 0)
    disks = []
    for i in range(3):
        p = h.pci(["pci0000:00", f"0000:00:0{i + 1}.0", f"0000:0{i + 1}:00.0"], b.SAMSUNG, 0xA80A,
                  b.NVME_CLASS, 0)
        disks.append(h.nvme(p, i, i * 4, parts=(64,) if i == 2 else ())[0])
    h.md("md0", "9:0", "raid0", disks[:2], 7680)
    h.mountinfo("23 22 0:21 / /proc rw,relatime - proc proc rw")
    h.file("/proc/swaps", "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
           "/dev/nvme2n1p1                          partition\t62499996\t0\t\t-2")
    h.write(tmp_path)
    facts = detect(load_offload({}), root=str(tmp_path / "md-unmounted"))
    assert [d.reason.split(";")[0] for d in facts.drives] == [
        "part of md0, which is not mounted", "part of md0, which is not mounted",
        "used as swap (nvme2n1p1)"]


def test_devices_are_named_in_the_order_of_their_first_directory() -> None:
    ds = drive_set("dgx-8nvme", {"store": {"paths": ["/data1/a", "/data4/a", "/data1/b"]}})
    assert ds.bandwidth.startswith("2 drives (nvme1n1, nvme4n1), ~15.8 GB/s combined")
    assert "offload.store.paths[0] /data1/a and offload.store.paths[2] /data1/b are on one " \
           "device" in ds.warnings[0]


def test_a_configured_directory_on_the_other_socket_is_a_warning() -> None:
    ds = drive_set("dgx-8nvme", {"store": {"paths": ["/data1/kv", "/data4/kv"]}},
                   {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    (w,) = ds.warnings
    assert w.startswith("offload.store.paths[1] /data4/kv is on nvme4n1 (on NUMA node 1, another "
                        "socket than the server's GPUs (GPU 0,1,2,3 (CUDA_VISIBLE_DEVICES=0,1,2,3)")
