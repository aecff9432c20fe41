"""Fixture machines -> expected decision (table-driven), and the fixture trees match their builder.

Each row: a machine under tests/fixtures/hosts/, a config, optionally a cache directory (a machine
path inside the root) and injected live probes; the expected role, path, whether blocks move from
GPU memory, and for each rejected path the check that must be named. The interpreter that would
run SGLang is tests/fixtures/pythons/all-cu13 (every path's Python side present, CUDA 13), unless
a row injects its own live probes (then the Python side is `not checked`).
"""

from __future__ import annotations

import dataclasses
import filecmp
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

from offload.cli import main
from offload.config import load_offload
from offload.errors import PathUnavailableError
from offload.hw import PathRejectedError, decide, detect, detect_and_decide
from offload.hw.live import CommandResult, Live
from tests.hw.hw_schema_check import validate

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
HOSTS = FIXTURES / "hosts"
SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "offload/hw/schema.json").read_text())
AGENT = {"agent": {"address": "10.0.0.2:7070"}}
ALL_CU13 = str(FIXTURES / "pythons" / "all-cu13")


def mlxconfig(value: str) -> Live:
    """Offline probes plus an mlxconfig that answers INTERNAL_CPU_OFFLOAD_ENGINE = value."""
    def run(argv: Any, timeout: float) -> CommandResult | None:
        if argv[0] != "mlxconfig":
            return None
        return CommandResult(0, "Device #1:\n----------\n\nConfigurations:        Default"
                                "         Current         Next Boot\n"
                                f"*       INTERNAL_CPU_OFFLOAD_ENGINE   ENABLED(0)   {value}"
                                f"   {value}\n")
    return Live(run=run)


# (machine, config, cache_dir, live, role, path, gpu_direct, {rejected path: check prefix})
CASES = [
    ("cpu-box", {}, None, None, "host", "cpu", False,
     {"dpu": "bluefield:", "gds": "gpu: no NVIDIA GPU"}),
    ("h100x8-gds", {}, "/raid/sglang-offload", None, "host", "gds", True,
     {"dpu": "bluefield:", "cpu": "preference:"}),
    ("h100x8-gds", {"transfer": {"path": "cpu"}}, "/raid/kv", None, "host", "cpu", False,
     {"dpu": "bluefield:", "gds": "transfer.path:"}),
    ("h100-bf3-dpu", AGENT, None, None, "host", "dpu", True,
     {"gds": "nvidia_fs:", "cpu": "preference:"}),
    ("h100-bf3-dpu", {}, None, None, "host", "cpu", False,
     {"dpu": "agent_address:", "gds": "nvidia_fs:"}),
    ("h100-bf3-nic", AGENT, None, None, "host", "cpu", False,
     {"dpu": "dpu_mode: BlueField-3 0000:a3:00.0 is in nic mode", "gds": "nvidia_fs:"}),
    ("h100-bf3-nic", {**AGENT, "hw": {"dpu_mode": "dpu"}}, None, None, "host", "dpu", True,
     {"gds": "nvidia_fs:"}),
    ("h100-bf2-sys", AGENT, None, mlxconfig("ENABLED(0)"), "host", "dpu", False,
     {"gds": "nvidia_fs:"}),
    ("h100-bf2-sys", AGENT, None, mlxconfig("DISABLED(1)"), "host", "cpu", False,
     {"dpu": "dpu_mode: BlueField-2 0000:83:00.0 is in nic mode"}),
    ("h100-bf2-sys", AGENT, None, None, "host", "cpu", False,
     {"dpu": "dpu_mode: BlueField-2 0000:83:00.0 is in unknown mode"}),
    ("h100-gds-overlay", {}, "/var/cache/sglang-offload", None, "host", "cpu", False,
     {"gds": "cache_fs: cache directory /var/cache/sglang-offload is on overlay",
      "dpu": "bluefield:"}),
    ("h100-gds-overlay", {}, "/dev/shm/kv", None, "host", "cpu", False,
     {"gds": "cache_fs: cache directory /dev/shm/kv is on tmpfs"}),
    ("h100-gds-overlay", {}, "/data/kv", None, "host", "gds", True, {"cpu": "preference:"}),
    ("bf3-arm", {}, "/var/lib/sglang-offload", None, "agent", "cpu", False,
     {"dpu": "platform:", "gds": "platform:"}),
    # GDS's silent compat mode: nvidia-fs must list the driver under the cache directory
    ("h100-gds-nvme-listed", {}, "/data/kv", None, "host", "gds", True, {"cpu": "preference:"}),
    ("h100-gds-nvme-unlisted", {}, "/data/kv", None, "host", "cpu", False,
     {"gds": "nvfs_modules: nvidia-fs does not list nvme, the driver of cache directory "
             "/data/kv (/proc/driver/nvidia-fs/modules lists nvme_rdma)"}),
    ("h100-gds-no-modules", {}, "/data/kv", None, "host", "cpu", False,
     {"gds": "nvfs_modules: nvidia_fs is loaded but /proc/driver/nvidia-fs/modules is missing"}),
]


@pytest.mark.parametrize("machine,cfg,cache,live,role,path,gpu_direct,rejected", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_machine_decision(machine: str, cfg: dict, cache: str | None, live: Live | None,
                          role: str, path: str, gpu_direct: bool, rejected: dict) -> None:
    config = load_offload(cfg)
    facts, d = detect_and_decide(config, root=str(HOSTS / machine), cache_dir=cache, live=live,
                                 python=ALL_CU13)
    assert (d.role, d.path, d.gpu_direct) == (role, path, gpu_direct), d
    got = {r.path: r for r in d.rejected}
    assert set(got) == {"dpu", "gds", "cpu"} - {path}
    for p, prefix in rejected.items():
        assert got[p].check.startswith(prefix), (p, got[p])
    for r in d.rejected:
        assert r.check and r.fix, r
    assert d.reasons


def test_bf2_across_sockets_is_sys_and_staged() -> None:
    facts, d = detect_and_decide(load_offload(AGENT), root=str(HOSTS / "h100-bf2-sys"),
                                 live=mlxconfig("ENABLED(0)"))
    dpu = next(x for x in facts.distances if x.target_kind == "dpu")
    assert dpu.level == "SYS"
    assert any("staged through pinned host memory" in r and "SYS" in r for r in d.reasons)
    card = facts.nics[0]
    assert (card.generation, card.mode, card.mode_source) == ("BlueField-2", "dpu", "mlxconfig")


def test_bf3_facts_name_their_evidence() -> None:
    facts = detect(load_offload({}), root=str(HOSTS / "h100-bf3-dpu"))
    (card,) = facts.nics
    assert card.kind == "bluefield" and card.generation == "BlueField-3"
    assert card.functions == ("0000:a3:00.0", "0000:a3:00.1") and card.rshim == "0000:a3:00.2"
    assert card.mode_source == "/dev/rshim0/misc" and "DPU mode" in (card.mode_evidence or "")
    assert {x.level for x in facts.distances if x.target_kind == "dpu"} == {"PXB"}
    assert facts.gpudirect_rdma.available and facts.doca.version == "2.9.1"
    assert facts.gpu_probe.nvml == "not checked" and facts.agent.reachable is None


def test_h100x8_topology_and_raid() -> None:
    facts = detect(load_offload({}), root=str(HOSTS / "h100x8-gds"), cache_dir="/raid/kv")
    assert len(facts.gpus) == 8 and len(facts.nvme) == 9
    assert facts.cache_dir.block_device == "md0"
    assert facts.cache_dir.nvme == ("nvme0", "nvme1", "nvme2", "nvme3")
    levels = {(x.gpu_index, x.target_name): x.level for x in facts.distances}
    assert levels[(0, "nvme0")] == "PIX" and levels[(0, "nvme2")] == "PHB"
    assert levels[(0, "nvme4")] == "SYS" and levels[(7, "nvme7")] == "PIX"
    assert [g.numa_node for g in facts.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("machine,cfg,cache,check", [
    ("bf3-arm", {"transfer": {"path": "gds"}}, None, "platform:"),
    ("cpu-box", {"transfer": {"path": "dpu"}, **AGENT}, None, "bluefield:"),
    ("cpu-box", {"transfer": {"path": "gds"}}, None, "gpu:"),
    ("h100-bf3-nic", {"transfer": {"path": "dpu"}, **AGENT}, None, "dpu_mode:"),
    ("h100-gds-overlay", {"transfer": {"path": "gds"}}, "/var/cache/kv", "cache_fs:"),
    ("h100-gds-nvme-unlisted", {"transfer": {"path": "gds"}}, "/data/kv", "nvfs_modules:"),
    ("h100-gds-no-modules", {"transfer": {"path": "gds"}}, "/data/kv", "nvfs_modules:"),
])
def test_explicit_path_that_cannot_work_is_an_error(machine: str, cfg: dict, cache: str | None,
                                                    check: str) -> None:
    config = load_offload(cfg)
    facts = detect(config, root=str(HOSTS / machine), cache_dir=cache)
    with pytest.raises(PathUnavailableError) as e:
        decide(facts, config)
    assert isinstance(e.value, PathRejectedError)
    assert e.value.check.startswith(check) and e.value.fix
    assert check.rstrip(":") in str(e.value)


def test_explicit_dpu_with_unreachable_agent() -> None:
    config = load_offload({"transfer": {"path": "dpu"}, **AGENT})
    live = Live(connect=lambda addr, timeout: (False, f"agent {addr} is not reachable: refused"))
    facts = detect(config, root=str(HOSTS / "h100-bf3-dpu"), live=live)
    with pytest.raises(PathRejectedError) as e:
        decide(facts, config)
    assert e.value.check.startswith("agent_reachable:")


@pytest.mark.parametrize("machine", sorted(p.name for p in HOSTS.iterdir()))
def test_cli_json_on_every_fixture_follows_the_schema(machine: str, capsys, tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("offload:\n  agent:\n    address: 10.0.0.2:7070\n")
    rc = main(["detect", "--root", str(HOSTS / machine), "--config", str(cfg), "--json",
               "--probe-io", "--python", ALL_CU13])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert validate(out, SCHEMA) == []
    assert out["facts"]["io"]["source"] == "not checked"
    assert out["decision"]["path"] in ("dpu", "gds", "cpu")


def test_cli_text_report_on_a_fixture(capsys) -> None:
    rc = main(["detect", "--root", str(HOSTS / "h100x8-gds"), "--cache-dir", "/raid/kv",
               "--python", ALL_CU13])
    text = capsys.readouterr().out
    assert rc == 0
    for part in ("Platform: inference host", "GPUs: 8", "NICs / DPUs: 4", "NVMe: 9",
                 "PCIe distance", "GPUDirect Storage: available", "Decision",
                 "role: host   path: gds", "rejected:", "- dpu: bluefield:"):
        assert part in text, part


def test_verbose_detect_logs_each_fact_with_where_it_was_read(caplog, capsys) -> None:
    with caplog.at_level("DEBUG", logger="offload.hw"):
        rc = main(["detect", "--root", str(HOSTS / "h100x8-gds"), "--cache-dir", "/raid/kv",
                   "--python", ALL_CU13])
    capsys.readouterr()
    debug = [r.getMessage() for r in caplog.records if r.levelname == "DEBUG"]
    assert rc == 0
    for fact in ("pci:", "platform:", "gpu_probe:", "gpus[7]:", "nics[0]:", "gds:", "nvme[0]:",
                 "cache_dir:", "agent:", "python:"):
        assert any(m.startswith(fact) for m in debug), fact
    assert any(m.startswith("gpus[0]:") and "(source: " in m for m in debug)


def test_cli_explicit_path_error_exit_1(capsys, tmp_path: Path) -> None:
    cfg = tmp_path / "gds.yaml"
    cfg.write_text("offload:\n  transfer:\n    path: gds\n")
    rc = main(["detect", "--root", str(HOSTS / "bf3-arm"), "--json", "--config", str(cfg)])
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert rc == 1 and validate(out, SCHEMA) == []
    assert out["decision"] is None and out["error"]["check"].startswith("platform:")
    assert "error: offload.transfer.path is 'gds'" in cap.err
    rc = main(["detect", "--root", str(HOSTS / "cpu-box"), "--config", str(cfg)])
    cap = capsys.readouterr()
    assert rc == 1 and "error: offload.transfer.path is 'gds'" in cap.out + cap.err
    assert "gpu: no NVIDIA GPU" in cap.err


def _tree(base: Path) -> dict[str, tuple[str, str]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(base):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(base))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_file():
                out[rel] = ("file", p.read_text())
    return out


def test_checked_in_fixtures_match_the_builder(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("build_hosts", FIXTURES / "build_hosts.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    names = mod.build(tmp_path)
    assert sorted(names) == sorted(p.name for p in HOSTS.iterdir())
    for name in names:
        assert _tree(tmp_path / name) == _tree(HOSTS / name), (
            f"{name}: run `python tests/fixtures/build_hosts.py` and commit the trees")
    assert filecmp.dircmp(tmp_path, HOSTS).left_only == []


def test_fixture_links_are_relative_and_stay_inside() -> None:
    for dirpath, dirnames, filenames in os.walk(HOSTS):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p.is_symlink():
                target = os.readlink(p)
                assert not target.startswith("/"), p
                machine = HOSTS / p.relative_to(HOSTS).parts[0]
                assert Path(os.path.realpath(p)).is_relative_to(machine.resolve()), p


def test_relative_cache_dir_with_a_fixture_root_is_bad_input(capsys) -> None:
    rc = main(["detect", "--root", str(HOSTS / "cpu-box"), "--cache-dir", "kv"])
    assert rc == 2 and "absolute path inside the root" in capsys.readouterr().err


@pytest.mark.parametrize("machine,why", [
    ("h100-gds-nvme-unlisted", "nvidia-fs does not list nvme, the driver of cache directory "
                               "/data/sglang-offload"),
    ("h100-gds-no-modules", "/proc/driver/nvidia-fs/modules is missing"),
])
def test_gds_compat_mode_reason_in_detect_and_launch_dry_run(machine: str, why: str, capsys,
                                                             tmp_path: Path) -> None:
    """The rejected GDS path names nvidia-fs's registered drivers in `detect` (text and JSON)
    and in `launch --dry-run`'s decision; the cpu path serves."""
    from tests.launch.helpers import run_cli

    cfg = tmp_path / "deploy.yaml"
    cfg.write_text("sglang:\n  model-path: meta-llama/Llama-3.1-8B-Instruct\n  page-size: 64\n"
                   "offload:\n  store:\n    path: /data/sglang-offload\n  transfer:\n"
                   "    path: auto\n")
    root = str(HOSTS / machine)
    rc, out, _ = run_cli(capsys, "detect", "--root", root, "--config", str(cfg),
                         "--python", ALL_CU13)
    assert rc == 0 and "path: cpu" in out
    assert "GPUDirect Storage: compat only (nvfs_modules: " in out and why in out
    assert "- gds: nvfs_modules: " in out
    rc, out, _ = run_cli(capsys, "detect", "--root", root, "--config", str(cfg), "--json",
                         "--python", ALL_CU13)
    data = json.loads(out)
    gds = next(r for r in data["decision"]["rejected"] if r["path"] == "gds")
    assert why in gds["check"] and "nvidia-fs" in gds["fix"]
    assert data["facts"]["gds"]["modules"] == (None if "no-modules" in machine else ["nvme_rdma"])
    rc, out, err = run_cli(capsys, "launch", "--config", str(cfg), "--dry-run", "--root", root,
                           "--python", ALL_CU13)
    assert rc == 0, err
    assert "gds: nvfs_modules: " in out and why in out


def test_the_driver_nvidia_fs_must_list_follows_the_block_device() -> None:
    """md over PCIe and NVMe-oF drives needs both drivers; a distributed file system its client."""
    from offload.hw.facts import CacheDir, Gds, Nvme
    from offload.hw.gds import nvfs_driver_support, parse_modules, required_drivers

    def nvme(name: str, transport: str) -> Nvme:
        return Nvme(name, None, None, None, transport, None, "live", None, 0, (), "fixture", "")

    def cache(fs: str, ctrls: tuple[str, ...]) -> CacheDir:
        return CacheDir("/kv", True, "/kv", fs, "/dev/md0", "rw", "9:0", "md0",
                        tuple(f"{c}n1" for c in ctrls), ctrls, None, "fixture", "")

    drives = [nvme("nvme0", "pcie"), nvme("nvme1", "rdma")]
    md = cache("xfs", ("nvme0", "nvme1"))
    assert required_drivers(md, drives) == [("nvme",), ("nvme_rdma",)]
    assert required_drivers(cache("lustre", ()), drives) == [("lnet", "lustre")]
    assert parse_modules("nvme: v1\n\nnvme_rdma: v1\nnvme: v1\n") == ("nvme", "nvme_rdma")
    g = Gds("2.29.4", None, None, 4, None, None, None, None, None, "loads", True, "fixture", "",
            modules=("nvme",))
    ok, why = nvfs_driver_support(g, md, drives)
    assert not ok and "does not list nvme_rdma" in why
    assert nvfs_driver_support(dataclasses.replace(g, modules=("nvme_rdma", "nvme")), md,
                               drives)[0]


def test_live_nvidia_fs_modules_are_read_through_the_injected_probe() -> None:
    """On the live machine the file is read with /dev/nvidia-fs0 held open (`Live.nvfs_modules`:
    nvidia-fs registers drivers only while a process has it open); that probe's answer is used."""
    live = Live(nvfs_modules=lambda: "nvme: v1\n")
    facts, d = detect_and_decide(load_offload({}), root=str(HOSTS / "h100-gds-no-modules"),
                                 cache_dir="/data/kv", live=live, python=ALL_CU13)
    assert facts.gds.modules == ("nvme",)
    assert d.path == "gds" and any("nvidia-fs lists nvme" in r for r in d.reasons)
