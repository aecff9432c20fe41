"""The operations pages' examples, checked: docs/deploy/kubernetes.yaml against the Kubernetes API
schema (kubernetes-validate's bundled schemas, strict: an unknown field fails; no network) and
against our own rules; docs/deploy/sglang-offload-agent.service with `systemd-analyze verify`;
every command line in them through our own parser; and every version of the patched build the
docs print equal to what a build makes now (distro/local-version)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from offload import cli
from offload.config import load_text
from offload.launch.checks import GB, SGLANG_HOST_RESERVE
from tests.distro.conftest import load_script

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "docs" / "deploy"
MANIFESTS = DEPLOY / "kubernetes.yaml"
UNIT = DEPLOY / "sglang-offload-agent.service"
UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "": 1,
         "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def manifests() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFESTS.read_text()) if d]


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in manifests() if d["kind"] == kind]


def quantity(text: str) -> int:
    m = re.fullmatch(r"([0-9]+)([A-Za-z]*)", str(text))
    assert m and m.group(2) in UNITS, text
    return int(m.group(1)) * UNITS[m.group(2)]


def workloads() -> list[dict[str, Any]]:
    return by_kind("StatefulSet") + by_kind("Deployment")


def deployment_file() -> str:
    (cm,) = by_kind("ConfigMap")
    return str(cm["data"]["config.yaml"])


def test_every_manifest_is_valid_kubernetes() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    version = kv.latest_version()
    docs = manifests()
    assert {d["kind"] for d in docs} >= {"ConfigMap", "Secret", "PersistentVolume", "StatefulSet",
                                         "Deployment", "Service", "StorageClass"}
    for d in docs:
        kv.validate(d, version, strict=True)
    bad = dict(docs[-1], spec={**docs[-1]["spec"], "portz": []})     # the check can fail
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, version, strict=True)


def test_the_config_map_is_a_valid_deployment_file_without_secrets(capsys, tmp_path) -> None:
    text = deployment_file()
    dep = load_text(text)                         # the strict loader: keys, types, conflicts
    assert dep.offload.store.salt == "" and dep.offload.store.salt_file
    cfg = tmp_path / "config.yaml"
    cfg.write_text(text)
    cfg.chmod(0o644)                               # a ConfigMap is world-readable
    rc = cli.main(["config", "validate", "--offline", str(cfg)])
    assert rc == 0, capsys.readouterr().err


def test_resources_fit_the_pinned_memory_and_the_gpus() -> None:
    sg = yaml.safe_load(deployment_file())["sglang"]
    pinned = int(sg["hicache-size"]) * GB * int(sg["tp-size"]) + SGLANG_HOST_RESERVE
    servers = [w for w in workloads() if w["metadata"]["name"] != "sglang-offload-agent"]
    assert len(servers) == 2
    for w in servers:
        (c,) = w["spec"]["template"]["spec"]["containers"]
        res = c["resources"]
        assert quantity(res["limits"]["memory"]) >= pinned, w["metadata"]["name"]
        assert res["requests"]["memory"] == res["limits"]["memory"]     # no overcommit of pins
        assert int(res["limits"]["nvidia.com/gpu"]) == int(sg["tp-size"])
        assert c["ports"][0]["containerPort"] == sg["port"]


def test_mounts_secrets_and_ports_agree() -> None:
    off = yaml.safe_load(deployment_file())["offload"]
    for w in workloads():
        spec = w["spec"]["template"]["spec"]
        assert "securityContext" not in spec or "fsGroup" not in spec["securityContext"], \
            "fsGroup makes secret files group-readable: the loader refuses them"
        (c,) = spec["containers"]
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        secret = volumes["secrets"]["secret"]
        assert secret["defaultMode"] == 0o400 and secret["secretName"] == "sglang-offload-secrets"
        # a Secret volume's files are symlinks into ..data/, which the loader refuses: each
        # file is mounted alone with subPath (a bind mount of the file itself)
        secret_mounts = [m for m in c["volumeMounts"] if m["name"] == "secrets"]
        assert all(m["mountPath"].endswith("/" + m["subPath"]) for m in secret_mounts)
        files = {m["mountPath"] for m in secret_mounts
                 if m["subPath"] in {i["path"] for i in secret["items"]}}
        if w["metadata"]["name"] == "sglang-offload-agent":
            args = c["args"]
            assert args[args.index("--secret-file") + 1] in files
            assert args[args.index("--store") + 1] == mounts["store"]
            assert args[args.index("--listen") + 1].endswith(f":{c['ports'][0]['containerPort']}")
        else:
            assert off["store"]["salt_file"] in files
            assert mounts["cache"] == off["store"]["path"]
            assert mounts["config"] == "/etc/sglang-offload/config.yaml"   # the image's default
    (pv,) = by_kind("PersistentVolume")
    (sts,) = by_kind("StatefulSet")
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == pv["spec"]["storageClassName"]
    for svc in by_kind("Service"):
        (port,) = svc["spec"]["ports"]
        target = [w for w in workloads()
                  if w["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]]
        assert target, svc["metadata"]["name"]
        (c,) = target[0]["spec"]["template"]["spec"]["containers"]
        assert port["targetPort"] in {p["name"] for p in c["ports"]}


def test_the_agent_command_lines_parse() -> None:
    """The agent's flags in the manifest and the unit are ones `sglang-offload agent` has."""
    (agent,) = [w for w in workloads() if w["metadata"]["name"] == "sglang-offload-agent"]
    (c,) = agent["spec"]["template"]["spec"]["containers"]
    lines = [c["args"][1:]]
    lines.append(unit_exec_start("/opt/sglang-offload/.venv/bin/sglang-offload")[1:])
    for argv in lines:
        argv = [a.replace("${CREDENTIALS_DIRECTORY}", "/run/credentials/x") for a in argv]
        _, args = cli._parser(argv)
        assert args.command == "agent" and args.listen[1] == 7400


def unit_exec_start(binary: str) -> list[str]:
    text = UNIT.read_text().replace("\\\n", " ")
    (line,) = [ln for ln in text.splitlines() if ln.startswith("ExecStart=")]
    argv = line[len("ExecStart="):].split()
    assert argv[0] == binary
    return argv


def test_the_systemd_unit_verifies(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (scripts/install.sh installs systemd)")
    ours = Path(sys.executable).parent / "sglang-offload"
    assert ours.exists(), ours
    unit = tmp_path / UNIT.name        # ExecStart must name an executable here: this checkout's
    unit.write_text(UNIT.read_text().replace("/opt/sglang-offload/.venv/bin/sglang-offload",
                                             str(ours)))
    res = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert res.returncode == 0 and res.stderr.strip() == "", res.stderr
    bad = tmp_path / "bad.service"                        # the check can fail
    bad.write_text(unit.read_text().replace("Restart=on-failure", "Restart=sometimes"))
    res = subprocess.run([tool, "verify", str(bad)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert "restart specifier" in res.stderr


# The patched build's version as docs print it: 0.5.23+offload.N (wheel) or 0.5.23-offload.N (tag).
BUILD = re.compile(r"\b(\d+\.\d+\.\d+)[+-](offload\.\d+)\b")


def test_docs_print_the_version_the_build_makes() -> None:
    bw = load_script(REPO / "distro" / "build_wheel.py", "sglang_offload_build_wheel")
    want = (bw.load_pin().version, bw.local_version())
    pages = sorted([*(REPO / "docs").rglob("*.md"), MANIFESTS, REPO / "README.md"])
    wrong = [f"{p.relative_to(REPO)}:{n}: {m.group(0)}" for p in pages
             for n, line in enumerate(p.read_text().splitlines(), 1)
             for m in BUILD.finditer(line) if (m.group(1), m.group(2)) != want]
    assert not wrong, f"the build makes {want[0]}+{want[1]} (distro/local-version): {wrong}"
    assert any(BUILD.search(p.read_text()) for p in pages)
