"""Secrets never leave (issue 18 point 4): marker secrets planted in every secret-bearing field,
every command and error path run, and all their output and logs searched for the markers.

Secret-bearing fields: `store.salt`, the password in `redis.url` (userinfo and `?password=`),
the contents of `redis.password_file`, `redis.secret_file` and `agent.secret_file`, the env
SGLANG_OFFLOAD_SECRET, SGLang's `api-key`. Paths run: `config validate` (valid and invalid
files, text and JSON), `detect --config` (a Redis and an agent on closed loopback ports),
`launch --dry-run` (text and JSON) and a real `launch` exec'ing a stand-in for SGLang's python,
`bench redis --url` at a closed port, the Redis tier against a closed port (logs, errors, the
counters the metrics export), and SGLang's own storage factory attaching our backend on CPU
with bad and unreachable settings (the exception SGLang logs and re-raises, and its logs).
Everything connects to loopback only.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest

from offload import cli
from offload.redact import MASK, config_secrets, text, url
from tests.store.redis_fixtures import free_port

REPO = Path(__file__).resolve().parents[1]
SALT = "SALTMARK7a1c9e"
PW = "PWMARK3b8d0f"              # in the URL
PW_FILE = "PWFILEMARK55e1c0"      # redis.password_file
REDIS_KEY = "REDISKEYMARK0123456789"
AGENT_KEY = "AGENTKEYMARK0123456789"
ENV_KEY = "ENVKEYMARK0123456789ab"
API_KEY = "APIKEYMARK9f2e"
MARKERS = (SALT, PW, PW_FILE, REDIS_KEY, AGENT_KEY, ENV_KEY, API_KEY)


def _closed_port() -> int:
    return free_port()          # bound then closed: nothing listens there


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("secrets")
    files = {}
    for name, value in (("pw", PW_FILE), ("redis.key", REDIS_KEY), ("agent.key", AGENT_KEY)):
        p = d / name
        p.write_text(value + "\n")
        p.chmod(0o600)
        files[name] = str(p)
    redis_port, agent_port = _closed_port(), _closed_port()
    offload = (f"offload:\n"
               f"  store: {{path: {d / 'cache'}, salt: {SALT}, capacity: 64MiB, min_free: 0}}\n"
               f"  transfer: {{path: cpu}}\n"
               f"  redis: {{url: 'redis://tenant:{PW}@127.0.0.1:{redis_port}', "
               f"password_file: {files['pw']}, secret_file: {files['redis.key']}, "
               f"timeout_s: 0.2, backoff_s: 0.1}}\n"
               f"  agent: {{address: '127.0.0.1:{agent_port}', transport: tcp, "
               f"secret_file: {files['agent.key']}, timeout_s: 0.5}}\n")
    sglang = ("sglang:\n  model-path: meta-llama/Llama-3.1-8B-Instruct\n  page-size: 64\n"
              f"  api-key: {API_KEY}\n  device: cpu\n")     # no GPU here: launch refuses one
    good = d / "good.yaml"
    good.write_text(sglang + offload)
    good.chmod(0o600)        # a config holding secrets must be private (offload.config.load_file)
    bad = {
        "bad port": offload.replace(f"127.0.0.1:{redis_port}'", "127.0.0.1:99999'"),
        "query": offload.replace(f"127.0.0.1:{redis_port}'", f"127.0.0.1:1?password={PW}'"),
        "slash in password": offload.replace(f"tenant:{PW}@", f"tenant:{PW}/x@"),
        "scheme": offload.replace("url: 'redis://", "url: 'http://"),
        "salt not a string": offload.replace(f"salt: {SALT}", f"salt: [{SALT}]"),
        "url as section": f"offload:\n  redis: 'redis://tenant:{PW}@127.0.0.1:1'\n",
        "tls on plain redis": offload.replace("timeout_s: 0.2,", f"tls_ca_file: {files['pw']},"),
        "yaml error": f"offload:\n  store:\n    salt: {SALT}: x\n",
        "bad sglang key": sglang + "  tp-sise: 1\n" + offload,
        "password file open": offload,             # made 0644 below
    }
    paths = {}
    for name, body in bad.items():
        p = d / (name.replace(" ", "-") + ".yaml")
        p.write_text(body)
        p.chmod(0o600)
        paths[name] = p
    loose = d / "loose-pw"
    loose.write_text(PW_FILE)
    loose.chmod(0o644)
    paths["password file open"].write_text(offload.replace(files["pw"], str(loose)))
    return {"dir": d, "good": good, "bad": paths, "files": files, "offload": offload,
            "redis_port": redis_port}


class Seen:
    """Everything a run printed or logged, searched for the markers at the end."""

    def __init__(self) -> None:
        self.chunks: list[tuple[str, str]] = []

    def add(self, what: str, *texts: str) -> None:
        self.chunks.extend((what, t) for t in texts)

    def assert_clean(self) -> None:
        leaks = [(what, m, t[max(0, t.find(m) - 80):t.find(m) + 40])
                 for what, t in self.chunks for m in MARKERS if m in t]
        assert not leaks, "secrets printed:\n" + "\n".join(f"{w}: {m} in ...{s}..."
                                                         for w, m, s in leaks)


@pytest.fixture
def seen(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("SGLANG_OFFLOAD_SECRET", ENV_KEY)
    monkeypatch.setenv("UCX_MODULES", "^ib")
    s = Seen()
    with caplog.at_level(logging.DEBUG):
        yield s
        s.add("logs", caplog.text)
    s.assert_clean()


def _cli(capsys: pytest.CaptureFixture[str], seen: Seen, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    seen.add(" ".join(argv[:2]), out, err)
    return rc, out, err


def test_redaction_primitives() -> None:
    assert url(f"redis://tenant:{PW}@h:1/2") == f"redis://tenant:{MASK}@h:1/2"
    assert url(f"rediss+cluster://:{PW}@a:1,b:2") == f"rediss+cluster://:{MASK}@a:1,b:2"
    assert url("redis://user@h") == "redis://user@h"             # a user name, no password
    assert url(f"redis://h:1?password={PW}") == f"redis://h:1?{MASK}"
    assert url("redis://h:6379") == "redis://h:6379"
    assert url(f"redis://h:1/0#{PW}") == f"redis://h:1/0#{MASK}"      # a fragment, too
    assert PW not in text(f"bad url redis://h:1/0#{PW} here")
    assert PW not in text(f"Error connecting to redis://u:{PW}@h:1 (x) and redis://h?password={PW}")
    assert text(f"salt is {SALT}.", [SALT]) == f"salt is {MASK}."
    from offload.config import load_offload

    cfg = load_offload({"store": {"salt": SALT}, "redis": {"url": f"redis://u:{PW}@h:1"}})
    assert {SALT, PW} <= set(config_secrets(cfg))
    assert SALT not in repr(cfg) and PW not in repr(cfg)       # reprs end up in tracebacks


def test_config_validate_and_detect(planted: dict[str, Any], seen: Seen,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    good = str(planted["good"])
    rc, out, _ = _cli(capsys, seen, "config", "validate", good)
    assert rc == 0 and f"salt: '{MASK}'" in out and f"tenant:{MASK}@127.0.0.1" in out
    assert f"api-key: '{MASK}'" in out
    assert _cli(capsys, seen, "config", "validate", "--json", good)[0] == 0
    for name, path in planted["bad"].items():
        rc, _, err = _cli(capsys, seen, "config", "validate", str(path))
        assert rc == 2 and err.startswith("error: "), (name, err)
        assert "Traceback" not in err, name
        _cli(capsys, seen, "detect", "--config", str(path))
    rc, _, err = _cli(capsys, seen, "detect", "--config", good)
    assert rc == 0, err
    port = planted["redis_port"]
    assert f"warning: offload.redis.url: Redis at 127.0.0.1:{port} is not reachable" in err
    assert "warning: offload.agent.address: agent 127.0.0.1:" in err
    _cli(capsys, seen, "detect", "--config", good, "--json")


def test_launch_dry_run_and_real(planted: dict[str, Any], seen: Seen,
                                 capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    good = str(planted["good"])
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    env = dict(os.environ, XDG_RUNTIME_DIR=str(xdg), PYTHONPATH=str(REPO),
               SGLANG_OFFLOAD_SECRET=ENV_KEY)
    os.environ["XDG_RUNTIME_DIR"] = str(xdg)
    try:
        for extra in ((), ("--json",)):
            rc, _, err = _cli(capsys, seen, "launch", "--config", good, "--dry-run", *extra)
            assert rc == 0, err
        for path in planted["bad"].values():
            _cli(capsys, seen, "launch", "--config", str(path), "--dry-run")
    finally:
        del os.environ["XDG_RUNTIME_DIR"]
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\n[ \"$1\" = -c ] && exec {sys.executable} \"$@\"\n"
                    "echo started; exit 0\n")
    fake.chmod(0o755)
    code = "import sys; from offload import cli; sys.exit(cli.main(sys.argv[1:]))"
    for cfg in (good, str(planted["bad"]["password file open"])):
        res = subprocess.run([sys.executable, "-c", code, "-v", "launch", "--config", cfg,
                              "--python", str(fake)], capture_output=True, text=True,
                             cwd=REPO, timeout=300, env=env)
        seen.add(f"launch {cfg}", res.stdout, res.stderr)
    assert "started" in res.stdout or res.returncode != 0


def test_bench_redis_url_at_a_closed_port(seen: Seen, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _cli(capsys, seen, "bench", "redis", "--url",
                      f"redis://tenant:{PW}@127.0.0.1:{_closed_port()}", "--sizes", "4KiB",
                      "--total", "64KiB", "--rounds", "1")
    assert rc != 0 and "error" in err


def test_redis_tier_at_a_closed_port(planted: dict[str, Any], seen: Seen) -> None:
    from offload.config import load_file
    from offload.errors import OffloadError
    from offload.keys import Namespace
    from offload.store.redis.store import RedisStore

    cfg = load_file(planted["good"]).offload
    store = RedisStore(cfg.redis)
    ns = Namespace("m", "bf16", "page_first", 16, salt=SALT)
    assert SALT not in repr(ns)
    key = ns.key("p")
    assert store.put_many([key], [[b"x" * 64]]) == [False]
    assert store.exists_many([key]) == [False]
    with pytest.raises(OffloadError) as e:
        store.ping()
    seen.add("redis", str(e.value), "".join(traceback.format_exception(e.value)),
             repr(store.link.counters()), repr(store.stats()))
    store.close()


def _attach(extra: dict[str, Any]) -> tuple[Any, str]:
    """SGLang's own storage factory builds our backend on a CPU host pool: (backend, error)."""
    from tests.hicache import hicache_pools as hp

    host = hp.host_pool(hp.device_pool(), "page_first", pages=8)
    try:
        return hp.make_backend(hp.storage_config(extra, metrics=True), host), ""
    except Exception as e:          # what SGLang's scheduler would log and re-raise
        return None, "".join(traceback.format_exception(e))


def test_errors_raised_inside_sglang_at_attach(planted: dict[str, Any], seen: Seen) -> None:
    pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")
    import yaml

    from tests.hicache import hicache_pools as hp

    tree = yaml.safe_load(planted["offload"])["offload"]
    tree["agent"] = {}
    d = planted["dir"]
    cases = {
        "bad url inline": {"redis": {"url": f"redis://tenant:{PW}@127.0.0.1:99999"}},
        "slash in password": {"redis": {"url": f"redis://tenant:{PW}/x@127.0.0.1:1"}},
        "salt not a string": {"store": {"salt": [SALT]}},
        "agent unreachable": {"transfer": {"path": "dpu"}, "agent": {
            "address": f"127.0.0.1:{_closed_port()}", "transport": "tcp",
            "secret_file": planted["files"]["agent.key"], "timeout_s": 0.5}},
    }
    for name, over in cases.items():
        t = {k: dict(v) for k, v in tree.items()}
        for k, v in over.items():
            t.setdefault(k, {}).update(v)
        backend, err = _attach({**hp.extra(str(d / "cache")), "offload": t})
        seen.add(f"attach {name}", err)
        if name == "agent unreachable":            # the data path: misses, logged
            _use(backend)
        else:
            assert backend is None and err, name
    # A file-based config (as launch writes it) with a bad URL, and a good one whose Redis is down.
    bad_file = d / "attach-bad.yaml"
    bad_file.write_text(f"offload:\n  redis: {{url: 'redis://tenant:{PW}@127.0.0.1:0'}}\n  "
                        f"store: {{salt: {SALT}}}\n")
    bad_file.chmod(0o600)
    extra = {k: v for k, v in hp.extra(str(d / "cache")).items() if k != "offload"}
    backend, err = _attach({**extra, "config_file": str(bad_file)})
    seen.add("attach config_file", err)
    assert backend is None and "offload.redis.url" in err
    backend, err = _attach({**hp.extra(str(d / "cache")), "offload": {
        k: v for k, v in tree.items() if k != "agent"}})
    assert backend is not None, err
    seen.add("stats", _use(backend))
    try:
        from prometheus_client import REGISTRY, generate_latest

        seen.add("metrics", generate_latest(REGISTRY).decode())
    except ImportError:
        pass


def _use(backend: Any) -> str:
    """One page stored and read back (misses where a tier is down); the stats, then close."""
    import torch

    from tests.hicache import hicache_pools as hp

    idx = torch.arange(0, hp.PAGE)
    backend.batch_set_v1([f"{1:064x}"], idx)
    backend.batch_get_v1([f"{1:064x}"], idx)
    stats = repr(backend.store.stats())
    backend.close()
    return stats
