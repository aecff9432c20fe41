"""Probes and checks one by one: parsers, PCIe distance, mounts, injected live probes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from offload.config import load_offload
from offload.errors import DetectError
from offload.hw import detect, staging_numa_node
from offload.hw.decide import decide, first_failure, gds_checks
from offload.hw.dpu import parse_mlxconfig, parse_rshim_misc
from offload.hw.facts import CacheDir, Gds, cache_numa_node, gpu_numa_node
from offload.hw.fsroot import Root
from offload.hw.gds import fs_gds_support, load_jsonc
from offload.hw.live import Live, NvmlGpu, NvmlReport, normalise_bdf, split_address
from offload.hw.pci import PciDevice, pcie_distance
from offload.hw.storage import find_mount, parse_mountinfo

HOSTS = Path(__file__).resolve().parents[1] / "fixtures" / "hosts"


def dev(chain: list[str], numa: int | None = 0) -> PciDevice:
    return PciDevice(bdf=chain[-1], vendor=0x10DE, device=0x2330, klass=0x030200, numa_node=numa,
                     driver=None, chain=tuple(chain), path="/sys/devices/" + "/".join(chain))


@pytest.mark.parametrize("a,b,level", [
    (["pci0000:00", "rp", "up", "d1", "g"], ["pci0000:00", "rp", "up", "d2", "n"], "PIX"),
    (["pci0000:00", "rp", "up", "d1", "g"], ["pci0000:00", "rp", "up", "d2", "u2", "d3", "n"],
     "PXB"),
    (["pci0000:00", "rp1", "g"], ["pci0000:00", "rp2", "n"], "PHB"),
    (["pci0000:00", "rp1", "g"], ["pci0000:40", "rp2", "n"], "NODE"),
])
def test_pcie_distance_levels(a: list[str], b: list[str], level: str) -> None:
    assert pcie_distance(dev(a), dev(b))[0] == level


def test_pcie_distance_sys_and_unknown() -> None:
    g, n = dev(["pci0000:00", "rp", "g"], 0), dev(["pci0000:80", "rp", "n"], 1)
    assert pcie_distance(g, n)[0] == "SYS"
    assert pcie_distance(g, dataclasses.replace(n, chain=()))[0] == "unknown"


def test_mountinfo_longest_prefix_and_escapes() -> None:
    mounts = parse_mountinfo(
        "22 1 259:1 / / rw - ext4 /dev/nvme0n1p1 rw\n"
        "30 22 259:3 / /mnt/my\\040disk rw - xfs /dev/nvme1n1 rw\n"
        "31 22 0:40 / /mnt rw - tmpfs tmpfs rw\n")
    assert find_mount(mounts, "/mnt/my disk/kv").fs_type == "xfs"
    assert find_mount(mounts, "/mnt/other").fs_type == "tmpfs"
    assert find_mount(mounts, "/mntx").fs_type == "ext4"
    assert find_mount(mounts, "/mnt/my disk", device="259:1").mount_point == "/"


def test_jsonc_comments_and_trailing_commas() -> None:
    data = load_jsonc('{\n // c\n "a": "http://x//y", /* b */ "p": {"k": [1, 2,],},\n}')
    assert data == {"a": "http://x//y", "p": {"k": [1, 2]}}


def test_rshim_and_mlxconfig_parsers() -> None:
    misc = parse_rshim_misc("BF_MODE         NIC mode\nDEV_NAME        pcie-0000:a3:00.2\n"
                            "DEV_INFO        BlueField-3(Rev 1)\n")
    assert misc["BF_MODE"] == "NIC mode" and misc["DEV_NAME"] == "pcie-0000:a3:00.2"
    out = ("Configurations:     Default     Current     Next Boot\n"
           "*     INTERNAL_CPU_OFFLOAD_ENGINE   ENABLED(0)   DISABLED(1)   DISABLED(1)\n")
    assert parse_mlxconfig(out) == "DISABLED(1)"
    assert parse_mlxconfig("Configurations:  Current\n  INTERNAL_CPU_OFFLOAD_ENGINE  ENABLED(0)") \
        == "ENABLED(0)"
    assert parse_mlxconfig("nothing here") is None


def test_bdf_and_address_helpers() -> None:
    assert normalise_bdf("00000000:1B:00.0") == "0000:1b:00.0"
    assert split_address("[fe80::1]:7070") == ("fe80::1", 7070)
    with pytest.raises(ValueError):
        split_address("nohost")


def test_root_errors(tmp_path: Path) -> None:
    with pytest.raises(DetectError, match="not a directory"):
        Root(str(tmp_path / "missing"))
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(DetectError, match="not a directory"):
        Root(str(f))


def _cache(fs: str, opts: str = "rw", disks: tuple[str, ...] = ("nvme0n1",)) -> CacheDir:
    return CacheDir(path="/kv", exists=True, mount_point="/", fs_type=fs, mount_source="x",
                    mount_options=opts, device="259:1", block_device=disks[0] if disks else None,
                    disks=disks, nvme=(), free_bytes=None, source="t", reason="t")


@pytest.mark.parametrize("cache,ok", [
    (_cache("ext4"), True), (_cache("xfs"), True), (_cache("lustre", disks=()), True),
    (_cache("ext4", "rw,data=journal"), False), (_cache("ext4", disks=("sda",)), False),
    (_cache("nfs4", "rw,proto=rdma", ()), True), (_cache("nfs4", "rw,proto=tcp", ()), False),
    (_cache("overlay", disks=()), False), (_cache("btrfs"), False), (_cache("zfs"), False),
])
def test_fs_gds_support(cache: CacheDir, ok: bool) -> None:
    assert fs_gds_support(cache)[0] is ok


def _gds_fixture(**gds_changes: object):
    facts = detect(load_offload({}), root=str(HOSTS / "h100x8-gds"), cache_dir="/raid/kv",
                   python=str(HOSTS.parent / "pythons" / "all-cu13"))
    return dataclasses.replace(facts, gds=dataclasses.replace(facts.gds, **gds_changes))


@pytest.mark.parametrize("changes,check", [
    ({"libcufile": "missing"}, "libcufile"),
    ({"run_udev": False}, "run_udev"),
    ({"force_compat_mode": True}, "cufile_json"),
    ({"nvidia_fs": None}, "nvidia_fs"),
])
def test_each_gds_check_can_reject(changes: dict, check: str) -> None:
    facts = _gds_fixture(**changes)
    d = decide(facts, load_offload({}))
    assert d.path == "cpu"
    assert next(r for r in d.rejected if r.path == "gds").check.startswith(check + ":")


def test_p2pdma_route_without_nvidia_fs_and_wsl() -> None:
    facts = _gds_fixture(nvidia_fs=None, use_pci_p2pdma=True, nvme_multipath=False)
    plat = dataclasses.replace(facts.platform, kernel="6.5.0-generic")
    assert decide(dataclasses.replace(facts, platform=plat), load_offload({})).path == "gds"
    facts = _gds_fixture()
    wsl = dataclasses.replace(facts.platform, kernel="5.15.153.1-microsoft-standard-WSL2")
    assert first_failure(gds_checks(dataclasses.replace(facts, platform=wsl))).name == "wsl"


def test_nvml_fake_gpu_and_missing_driver() -> None:
    gpu = NvmlGpu(0, "0000:12:00.0", "NVIDIA H100 80GB HBM3", 80 << 30, None, False)
    live = Live(nvml=lambda: NvmlReport("ok", "NVML driver 550: 1 GPU(s)", (gpu,), "550.127"))
    facts = detect(load_offload({}), root=str(HOSTS / "h100x8-gds"), live=live,
                   cache_dir="/raid/kv")
    (g,) = facts.gpus
    assert (g.source, g.numa_node, g.memory_bytes) == ("nvml", 0, 80 << 30)  # NUMA from sysfs
    assert facts.gpu_probe.nvml == "ok"
    down = Live(nvml=lambda: NvmlReport("unavailable", "NVML did not initialise: Driver Not "
                                        "Loaded"))
    facts = detect(load_offload({}), root=str(HOSTS / "h100x8-gds"), live=down,
                   cache_dir="/raid/kv")
    assert len(facts.gpus) == 8 and facts.gpu_probe.nvml == "unavailable"
    d = decide(facts, load_offload({}))
    assert d.path == "cpu"
    assert next(r for r in d.rejected if r.path == "gds").check.startswith("gpu:")


def test_agent_reachability_is_probed_through_the_injected_connect() -> None:
    cfg = load_offload({"agent": {"address": "10.0.0.2:7070"}})
    seen = []
    live = Live(connect=lambda a, t: (seen.append(a) or True, f"agent {a} accepted"))
    facts = detect(cfg, root=str(HOSTS / "h100-bf3-dpu"), live=live)
    assert seen == ["10.0.0.2:7070"] and facts.agent.reachable is True
    assert decide(facts, cfg).path == "dpu"


def test_operator_override_nic_wins_over_rshim() -> None:
    cfg = load_offload({"agent": {"address": "10.0.0.2:7070"}, "hw": {"dpu_mode": "nic"}})
    facts = detect(cfg, root=str(HOSTS / "h100-bf3-dpu"))
    assert facts.nics[0].mode == "nic" and facts.nics[0].mode_source == "config"
    assert "detected: dpu from /dev/rshim0/misc" in facts.nics[0].mode_evidence
    assert decide(facts, cfg).path == "cpu"


def test_dpu_port_down_is_rejected() -> None:
    cfg = load_offload({"agent": {"address": "10.0.0.2:7070"}})
    facts = detect(cfg, root=str(HOSTS / "h100-bf3-dpu"))
    rdma = tuple(dataclasses.replace(r, ports=tuple(dataclasses.replace(p, state="DOWN")
                                                    for p in r.ports)) for r in facts.rdma)
    d = decide(dataclasses.replace(facts, rdma=rdma), cfg)
    assert next(r for r in d.rejected if r.path == "dpu").check.startswith("rdma_port:")
    no_doca = dataclasses.replace(facts, doca=dataclasses.replace(facts.doca, present=False))
    d = decide(no_doca, cfg)
    assert next(r for r in d.rejected if r.path == "dpu").check.startswith("doca:")
    no_gdr = dataclasses.replace(facts, gpudirect_rdma=dataclasses.replace(
        facts.gpudirect_rdma, available=False))
    d = decide(no_gdr, cfg)
    assert d.path == "dpu" and not d.gpu_direct


def test_numa_helpers() -> None:
    facts = detect(load_offload({}), root=str(HOSTS / "h100x8-gds"), cache_dir="/raid/kv")
    assert gpu_numa_node(facts, 5) == 1 and gpu_numa_node(facts, 99) is None
    assert cache_numa_node(facts) == 0
    assert staging_numa_node(facts, None, 6) == 1
    assert staging_numa_node(facts, load_offload({"transfer": {"numa_node": 1}})) == 1
    cpu = detect(load_offload({}), root=str(HOSTS / "cpu-box"))
    assert staging_numa_node(cpu) == 0  # no GPU: the cache NVMe's node


def test_gds_fields_from_fixture() -> None:
    facts = detect(load_offload({}), root=str(HOSTS / "h100x8-gds"), cache_dir="/raid/kv")
    g: Gds = facts.gds
    assert (g.nvidia_fs, g.gds_version, g.peerdirect, g.devices) == ("2.22.3", "1.12.1.50",
                                                                     True, 4)
    assert g.cufile_json == "/etc/cufile.json" and g.allow_compat_mode is True
    assert g.libcufile == "not checked" and g.run_udev
