"""Real redis-server processes for the Redis tier tests, and the "replica" script they run.

Fixtures (import them into a test module): `redis_factory` (start servers with any arguments;
all are killed at teardown), `redis_server` (standalone, AOF with fsync always, in tmp_path),
`tls_certs` (a CA, a server and a client certificate made with the openssl CLI),
`redis_cluster` (3 masters, `redis-cli --cluster create`).

Run as a script, this file is one replica: `python redis_fixtures.py SPEC.json OUT.json` builds
TieredStore(MemoryStore, RedisStore) from the spec (url, salt, op put|get, pages, size) and writes
per-page results and stats as JSON (no pickle between processes).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
THIS = Path(__file__).resolve()
REPO = THIS.parents[2]


def free_port(bus: bool = False, also: int = 0) -> int:
    """A free TCP port p on loopback (and p + `also` free too: `bus` is the cluster bus, +10000)."""
    also = 10000 if bus else also
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not also:
            return port
        if port + also < 65536:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + also))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port")


def redis_store(url: str, timeout_s: float, backoff_s: float, /, **redis: object) -> Any:
    """A RedisStore on `url` built through the config loader (keys in `redis` win)."""
    from offload.config import load_offload
    from offload.store.redis.store import RedisStore

    cfg = {"url": url, "timeout_s": timeout_s, "backoff_s": backoff_s, **redis}
    return RedisStore(load_offload({"redis": cfg}).redis)


def block_bytes(page: str, size: int, salt: str = "") -> bytes:
    """Deterministic content of one test block."""
    return hashlib.shake_256(f"{salt}|{page}".encode()).digest(size)


class RedisProc:
    """One redis-server in its own directory; restartable on the same port and data."""

    def __init__(self, workdir: Path, extra: list[str], port: int | None = None,
                 tls: bool = False, password: str | None = None):
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port(bus="--cluster-enabled" in extra)
        self.extra = extra
        self.tls = tls
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.dir / "redis.log"

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0) -> "RedisProc":
        self.log.write_text("")
        port_args = (["--port", "0", "--tls-port", str(self.port)] if self.tls
                     else ["--port", str(self.port)])
        args = [REDIS_SERVER, *port_args, "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--logfile", str(self.log), "--save", "", *self.extra]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while "Ready to accept connections" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited: {err or self.log.read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server not ready: {self.log.read_text()}")
            time.sleep(0.02)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if sig == signal.SIGKILL:
                os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process must die too
            os.kill(self.proc.pid, sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.proc.wait(15)

    def client(self, **kw: Any) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, **kw)


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[Callable[..., RedisProc]]:
    procs: list[RedisProc] = []

    def start(extra: list[str] | None = None, name: str = "redis", **kw: Any) -> RedisProc:
        p = RedisProc(tmp_path / f"{name}{len(procs)}", list(extra or []), **kw)
        procs.append(p)
        return p.start()

    yield start
    for p in procs:
        p.kill()


@pytest.fixture
def redis_server(redis_factory: Callable[..., RedisProc]) -> RedisProc:
    """Standalone, persistent: AOF with fsync always (a SIGKILL loses nothing)."""
    return redis_factory(["--appendonly", "yes", "--appendfsync", "always"])


def tls_unavailable() -> str | None:
    """Why TLS cannot be tested here, or None."""
    if not shutil.which("openssl"):
        return "the openssl CLI is not installed (needed to make a self-signed certificate)"
    # A build without TLS rejects the directive; one with TLS exits for having no port at all.
    out = subprocess.run([REDIS_SERVER, "--port", "0", "--tls-port", "0"],
                         capture_output=True, text=True, timeout=10)
    text = (out.stdout + out.stderr).strip()
    if "Bad directive" in text or "not supported" in text.lower():
        return f"redis-server was built without TLS: {text.splitlines()[-1]}"
    return None


@pytest.fixture
def tls_certs(tmp_path: Path) -> dict[str, str]:
    reason = tls_unavailable()
    if reason:
        pytest.skip(reason)
    d = tmp_path / "tls"
    d.mkdir()

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
        "-keyout", "ca.key", "-out", "ca.crt")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr")
        ssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", f"{name}.crt")
    for f in d.iterdir():        # keys private: the tier refuses a key others can read
        f.chmod(0o600 if f.suffix == ".key" else 0o644)
    return {k: str(d / f"{k.replace('_', '.')}") for k in
            ("ca_crt", "server_crt", "server_key", "client_crt", "client_key")}


@pytest.fixture
def redis_cluster(redis_factory: Callable[..., RedisProc]) -> list[RedisProc]:
    nodes = [redis_factory(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                            "--cluster-node-timeout", "2000", "--appendonly", "no"],
                           name="cluster") for _ in range(3)]
    subprocess.run([REDIS_CLI, "--cluster", "create",
                    *[f"127.0.0.1:{n.port}" for n in nodes],
                    "--cluster-replicas", "0", "--cluster-yes"],
                   check=True, capture_output=True, timeout=60)
    deadline = time.monotonic() + 30
    for n in nodes:
        c = n.client()
        while c.cluster("info").get("cluster_state") != "ok":
            if time.monotonic() > deadline:
                raise RuntimeError("the 3-node cluster did not reach cluster_state:ok")
            time.sleep(0.05)
    return nodes


def run_replica(spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Run one replica in a new Python process; returns its JSON result."""
    n = len(list(tmp.glob("replica-*.json")))
    spec_file, out_file = tmp / f"replica-{n}.json", tmp / f"replica-{n}-out.json"
    spec_file.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(THIS), str(spec_file), str(out_file)],
                          capture_output=True, text=True, timeout=120, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"replica failed ({proc.returncode}): {proc.stderr}")
    return json.loads(out_file.read_text())


def _replica_main(spec_path: str, out_path: str) -> None:
    from offload.config import load_offload
    from offload.keys import Namespace
    from offload.store.memory.store import MemoryStore
    from offload.store.redis.store import RedisStore
    from offload.store.tiered import TieredStore, policy_from_config

    spec = json.loads(Path(spec_path).read_text())
    cfg = load_offload({"redis": {"url": spec["url"], "timeout_s": 2.0}}).redis
    ns = Namespace("test-model", "bf16", "layer_first", 16, salt=spec.get("salt", ""))
    store = TieredStore(MemoryStore(), RedisStore(cfg), policy_from_config(cfg))
    pages, size = spec["pages"], int(spec["size"])
    keys = [ns.key(p) for p in pages]
    if spec["op"] == "put":
        res = store.put_many(keys, [[block_bytes(p, size, spec.get("salt", ""))] for p in pages])
        match = res
    else:
        dests = [bytearray(size) for _ in pages]
        res = store.get_many(keys, [[d] for d in dests])
        match = [ok and bytes(d) == block_bytes(p, size, spec.get("salt", ""))
                 for ok, d, p in zip(res, dests, pages)]
    st = store.stats()
    store.close()
    Path(out_path).write_text(json.dumps({"results": res, "match": match,
                                          "tiers": st.extra["tiers"],
                                          "shared": {k: v for k, v in st.extra["shared"].items()
                                                     if isinstance(v, (int, float, str))}}))


if __name__ == "__main__":
    _replica_main(sys.argv[1], sys.argv[2])
