"""What would fail at start is caught by `config validate`, `detect` and `launch` (issue 19):
ports, NUMA nodes that exist, secret files, the cache directory, non-UTF-8 files, every problem
at once; an unreachable Redis or agent is a warning in detect naming its address (loopback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from offload import cli
from offload.config import ConfigError, OffloadConfig, load_offload
from offload.hw.fsroot import Root
from offload.hw.host_checks import check_host, numa_nodes
from offload.hw.storage import probe_cache_dir
from tests.store.redis_fixtures import free_port

REPO = Path(__file__).resolve().parents[2]
SGLANG = ("sglang:\n  model-path: meta-llama/Llama-3.1-8B-Instruct\n  page-size: 64\n"
          "  device: cpu\n")   # no GPU here: launch refuses a GPU deployment


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, list[str]]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, [ln for ln in err.splitlines() if ln.strip()]


def write(tmp_path: Path, text: str, name: str = "deploy.yaml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def problems(tree: dict) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_offload(tree)
    return e.value.problems


@pytest.mark.parametrize("port", [99999, -5, 0])
def test_metrics_port_out_of_range(port: int) -> None:
    (line,) = problems({"metrics": {"port": port}})
    assert line.startswith(f"offload.metrics.port: {port} is out of range; use a TCP port 1..65535")


def test_every_problem_at_once() -> None:
    lines = problems({"store": {"capacity": "abc", "io_threads": 0},
                      "agent": {"address": "h:99999"}, "redis": {"url": "redis://h:0"}})
    assert [ln.split(":")[0] for ln in lines] == [
        "offload.store.capacity", "offload.store.io_threads", "offload.agent.address",
        "offload.redis.url"], lines
    # A type problem is not reported again as a range problem against the default standing in.
    assert problems({"store": {"high_watermark": "x", "low_watermark": 0.99}}) == [
        "offload.store.high_watermark: 'x' is not a number"]


def _machine(tmp_path: Path, nodes: list[int] | None) -> Root:
    root = tmp_path / "machine"
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/mountinfo").write_text(
        "22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw\n"
        "23 22 0:21 / /proc rw,nosuid shared:12 - proc proc rw\n")
    (root / "etc").mkdir()
    (root / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    for n in nodes or []:
        (root / f"sys/devices/system/node/node{n}").mkdir(parents=True)
    return Root(str(root))


def test_numa_node_must_exist_on_the_machine(tmp_path: Path) -> None:
    one = _machine(tmp_path, [0])
    assert numa_nodes(one) == (0,)
    cfg = load_offload({"transfer": {"numa_node": 7}, "store": {"path": "/var/cache/x"}})
    (line,) = check_host(cfg, one).errors
    assert line.startswith("offload.transfer.numa_node: 7 is not a NUMA node of this machine "
                           "(nodes: 0 in /sys/devices/system/node)")
    ok = load_offload({"transfer": {"numa_node": 0}, "store": {"path": "/var/cache/x"}})
    assert check_host(ok, one).errors == ()
    assert problems({"transfer": {"numa_node": -1}})[0].startswith("offload.transfer.numa_node: -1")


def test_numa_node_in_detect_on_this_machine(capsys, tmp_path: Path) -> None:
    nodes = numa_nodes(Root("/"))
    if nodes is None:
        pytest.skip("this machine has no /sys/devices/system/node")
    bad = max(nodes) + 4096
    cfg = write(tmp_path, f"offload:\n  transfer: {{numa_node: {bad}}}\n"
                f"  store: {{path: {tmp_path / 'c'}}}\n")
    for argv in (("detect", "--config", cfg), ("config", "validate", cfg)):
        rc, out, err = run(capsys, *argv)
        assert rc == 2 and f"NUMA node {bad}" not in out, argv
        assert err == [e for e in err if e.startswith("error: offload.transfer.numa_node")], err


def test_cache_dir_on_procfs_or_a_file(capsys, tmp_path: Path) -> None:
    m = _machine(tmp_path, None)
    cfg = OffloadConfig()
    (proc,) = check_host(cfg, m, "/proc/1").errors
    assert proc.startswith("--cache-dir /proc/1 is on a proc file system, which cannot hold")
    (file_,) = check_host(cfg, m, "/etc/passwd").errors
    assert "exists and is not a directory" in file_
    assert "not a directory" in probe_cache_dir(m, "/etc/passwd").reason
    assert "does not exist yet" in probe_cache_dir(m, "/var/cache/new").reason
    rc, out, err = run(capsys, "detect", "--cache-dir", "/proc/1")
    assert rc == 2 and "O_DIRECT I/O on proc" not in out and "proc file system" in err[0]
    f = tmp_path / "a-file"
    f.write_text("x")
    rc, _, err = run(capsys, "detect", "--cache-dir", str(f))
    assert rc == 2 and err == [f"error: --cache-dir {f} exists and is not a directory; name a "
                               "directory (it is created if missing)"]


def _files(tmp_path: Path) -> dict[str, str]:
    out = {}
    for name, body, mode in (("ok", "0123456789abcdef0123", 0o600), ("open", "pw", 0o644),
                             ("short", "short", 0o600)):
        p = tmp_path / name
        p.write_text(body)
        p.chmod(mode)
        out[name] = str(p)
    out["missing"] = str(tmp_path / "missing")
    return out


def test_secret_files_are_checked_before_start(capsys, tmp_path: Path) -> None:
    f = _files(tmp_path)
    cfg = write(tmp_path, SGLANG + f"offload:\n  store: {{path: {tmp_path / 'c'}}}\n"
                f"  redis: {{url: 'redis://127.0.0.1:1', password_file: {f['missing']}, "
                f"secret_file: {f['short']}}}\n  agent: {{secret_file: {f['open']}}}\n")
    want = [f"error: offload.redis.password_file: cannot read {f['missing']}: No such file or "
            "directory",
            f"error: offload.redis.secret_file: {f['short']} holds 5 bytes; use at least 16 (e.g. "
            f"`openssl rand -hex 32 > {f['short']}`)",
            f"error: offload.agent.secret_file: {f['open']} has mode 644, which lets other users "
            f"read or change it; run `chmod 600 {f['open']}`"]
    for argv in (("config", "validate", cfg), ("detect", "--config", cfg)):
        rc, _, err = run(capsys, *argv)
        assert (rc, err) == (2, want), argv
    rc, _, err = run(capsys, "launch", "--config", cfg, "--dry-run", "--json")
    assert rc == 0 and [e for e in err if "_file: " in e] == [
        w.replace("error: ", "warning: ") + " (launch refuses to start without --dry-run)"
        for w in want]
    # The real launch refuses before it execs (a stand-in for SGLang's python says if it ran).
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\n[ \"$1\" = -c ] && exec {sys.executable} \"$@\"\necho started\n")
    fake.chmod(0o755)
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    res = subprocess.run([sys.executable, "-c", "import sys; from offload import cli; "
                          "sys.exit(cli.main(sys.argv[1:]))", "launch", "--config", cfg,
                          "--python", str(fake)], capture_output=True, text=True, cwd=REPO,
                         timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO),
                                               XDG_RUNTIME_DIR=str(xdg)))
    assert res.returncode == 2 and "started" not in res.stdout, res.stderr
    assert [ln for ln in res.stderr.splitlines() if ln.startswith("error:")] == want
    good = write(tmp_path, f"offload:\n  store: {{path: {tmp_path / 'c'}}}\n"
                 f"  redis: {{url: 'redis://127.0.0.1:1', password_file: {f['ok']}, "
                 f"secret_file: {f['ok']}}}\n", "good.yaml")
    assert run(capsys, "config", "validate", good)[0] == 0


def test_non_utf8_and_yaml_errors_are_one_line(capsys, tmp_path: Path) -> None:
    p = tmp_path / "latin1.yaml"
    p.write_bytes(b"offload:\n  store: {path: /tmp/caf\xe9}\n")
    for argv in (("config", "validate", str(p)), ("detect", "--config", str(p))):
        rc, _, err = run(capsys, *argv)
        assert rc == 2 and err == [f"error: {p}: not UTF-8 text (byte 0xe9 at offset 33); save "
                                   "the config file as UTF-8"], argv
    bad = write(tmp_path, "offload:\n  store:\n    salt: s3cr3t-salt: x\n", "bad.yaml")
    rc, _, err = run(capsys, "config", "validate", bad)
    assert rc == 2 and len(err) == 1 and "line 3, column" in err[0] and "s3cr3t" not in err[0]


def test_unreachable_redis_and_agent_are_warnings_naming_the_address(capsys, tmp_path) -> None:
    rp, ap = free_port(), free_port()         # closed loopback ports
    cfg = write(tmp_path, f"offload:\n  store: {{path: {tmp_path / 'c'}}}\n"
                f"  redis: {{url: 'redis://u:pw@127.0.0.1:{rp}'}}\n"
                f"  agent: {{address: '127.0.0.1:{ap}', timeout_s: 0.5}}\n")
    os.chmod(cfg, 0o600)              # it holds a Redis password: a loose file is refused
    rc, _, err = run(capsys, "detect", "--config", cfg)
    assert rc == 0
    warns = [e for e in err if e.startswith("warning:")]
    assert any(f"Redis at 127.0.0.1:{rp} is not reachable" in w for w in warns), err
    assert any(f"agent 127.0.0.1:{ap} is not reachable" in w for w in warns), err


def test_config_validate_does_not_import_sglang_s_parser() -> None:
    """The sglang: section is checked against the snapshot of the installed release's parser
    (checked equal to it by tests/launch), so validate does not import SGLang (torch)."""
    code = ("import sys; from offload import cli; rc = cli.main(['config', 'validate', "
            f"'{REPO / 'configs' / 'cpu-dev.yaml'}']); "
            "print('IMPORTED' if 'sglang.srt.server_args' in sys.modules else 'LAZY', rc)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert res.stdout.splitlines()[-1] == "LAZY 0", res.stderr


def test_every_directory_of_paths_is_checked(tmp_path: Path) -> None:
    m = _machine(tmp_path, None)
    cfg = load_offload({"store": {"paths": [str(tmp_path / "ok"), "/proc/1", "/etc/passwd"]}})
    errors = check_host(cfg, m).errors
    assert [e.split(" is ")[0].split(" exists")[0] for e in errors] == [
        "offload.store.paths[1]: /proc/1", "offload.store.paths[2]: /etc/passwd"]
