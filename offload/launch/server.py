"""A server started through `sglang-offload launch`, for `bench serve` and the end-to-end tests.

Primitives:
- `free_port(host)`: a free TCP port on a loopback address (bind to port 0, read it back).
- `LaunchedServer.start(config, log, url, python, env, launch_args, extra)`: `python -m offload.cli
  launch --config FILE [LAUNCH_ARGS] [-- EXTRA]` in its own session (SGLang and its scheduler /
  detokenizer children share its process group), stdout and stderr to `log`;
  `wait_ready(timeout)` polls `/model_info` until SGLang answers, its process exits (RunError
  naming the log; `tail()` reads its last lines) or the time is up.
- `generate(prompt or token ids, max_new_tokens) -> Reply`: one greedy `/generate` request (text,
  or `input_ids` for an exact length with any model); the reply's text, token ids,
  `cached_tokens`, SGLang's breakdown (device / host / storage tokens), the seconds to the
  first token (the request streams, so the first chunk is the first token) and its `answer`
  (`offload.agree.Answer`: each token's logprob and top-k, to `compare` with another reply).
- `wait_store(dir, blocks)`: poll until a write-back landed.
- `store_usage(dir) -> (blocks, data bytes)` of a cache directory (0, 0 before its first block),
  read through the store as `cache stats` does (safe while the server writes).
- `stop()` (SIGTERM to the group by the launch PID, SIGKILL after `grace` seconds) and `kill()`
  (SIGKILL at once: a crash). Only loopback addresses are contacted.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from offload.agree import REQUEST, Answer, Streamed
from offload.errors import RunError


def store_usage(directory: str | Path) -> tuple[int, int]:
    """(blocks, data bytes) in a cache directory; (0, 0) when it holds no index yet."""
    if not (Path(directory) / "index.db").exists():
        return 0, 0
    from offload.store.factory import open_existing

    store = open_existing(str(directory))
    try:
        return store.stats().blocks, sum(n["data_bytes"] for n in store.summary()["namespaces"])
    finally:
        store.close()


def wait_store(directory: str | Path, blocks: int, timeout: float = 120.0) -> int:
    """Poll until the directory holds `blocks` blocks (a write-back finished); the count seen."""
    deadline = time.monotonic() + timeout
    n = store_usage(directory)[0]
    while n < blocks and time.monotonic() < deadline:
        time.sleep(0.5)
        n = store_usage(directory)[0]
    return n


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _refuse_failed(url: str, chunk: dict[str, Any]) -> None:
    """SGLang streams a failed request as HTTP 200 with `{"error": ...}` (an input longer than
    the context, ...) and an aborted one as a chunk whose finish_reason is `abort`: RunError,
    never a short reply that would compare as an answer."""
    if not isinstance(chunk, dict) or "error" in chunk:
        raise RunError(f"{url}/generate: the server answered {str(chunk)[:300]}")
    finish = (chunk.get("meta_info") or {}).get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise RunError(f"{url}/generate: the request was aborted: {finish.get('message')}")


@dataclass
class Reply:
    text: str
    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    details: dict[str, Any]              # SGLang's cached_tokens_details: device, host, storage
    ttft_s: float                        # request sent -> first streamed chunk
    total_s: float
    answer: Answer                       # ids, logprobs, top-k (offload.agree): compare()


def group_members(pgid: int, but: int | None = None, proc: Path = Path("/proc")) -> list[int] | None:
    """Live processes (zombies not counted) of process group `pgid` other than `but`, read from
    /proc; None where that is not known (no /proc, another pid namespace's, entries hidden by
    hidepid): stop then waits out its grace, as before."""
    try:
        entries = [e for e in os.listdir(proc) if e.isdigit()]
        if (proc / "self").is_symlink() and os.readlink(proc / "self") != str(os.getpid()):
            return None                         # another pid namespace's /proc: not ours
    except OSError:
        return None
    out = []
    for e in entries:
        try:
            stat = (proc / e / "stat").read_text()
        except PermissionError:
            return None                         # hidden (hidepid): the group is not known
        except OSError:
            continue                            # exited meanwhile
        fields = stat[stat.rfind(")") + 2:].split()     # state, ppid, pgrp, ... (comm may hold spaces)
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X") \
                and int(e) != but:
            out.append(int(e))
    return out


def outlives_its_leader(pid: int, proc: Path = Path("/proc")) -> bool:
    """Whether `pid` is multiprocessing's resource tracker (SGLang's processes start one): it
    ignores SIGTERM by design and exits, cleaning up, once the processes it serves have; or a
    process gone meanwhile."""
    try:
        return b"multiprocessing.resource_tracker" in (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return True


@dataclass
class LaunchedServer:
    url: str                             # http://127.0.0.1:PORT
    proc: subprocess.Popen[bytes] | None      # None: a server someone else started (`at`)
    log: Path

    @classmethod
    def at(cls, url: str) -> "LaunchedServer":
        """A running server this process did not start: requests only (stop does nothing)."""
        return cls(url.rstrip("/"), None, Path("/dev/null"))

    @classmethod
    def start(cls, config: str | Path, log: str | Path, url: str, python: str = sys.executable,
              env: Mapping[str, str] | None = None, launch_args: list[str] | None = None,
              extra: list[str] | None = None) -> "LaunchedServer":
        """Start `sglang-offload launch --config CONFIG [LAUNCH_ARGS] [-- EXTRA]` (the config
        names host and port, `url` is where they answer)."""
        log = Path(log)
        argv = [python, "-m", "offload.cli", "launch", "--config", str(config), *(launch_args or [])]
        if extra:
            argv += ["--", *extra]
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **(env or {})}, start_new_session=True)
        return cls(url.rstrip("/"), proc, log)

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RunError(f"the server exited with {self.proc.returncode} before it answered "
                               f"(its log: {self.log})")
            try:       # SGLang's answer names the model (not some other server on the port)
                with urllib.request.urlopen(self.url + "/model_info", timeout=5) as r:
                    if r.status == 200 and "model_path" in json.loads(r.read() or b"{}"):
                        return
            except (OSError, urllib.error.URLError, ValueError, TypeError):
                pass
            time.sleep(0.5)
        raise RunError(f"the server did not answer {self.url} within {timeout:.0f} s (its log: "
                       f"{self.log})")

    def generate(self, prompt: str | list[int], max_new_tokens: int = 8, timeout: float = 600.0,
                 ignore_eos: bool = False) -> Reply:
        body = json.dumps({"text" if isinstance(prompt, str) else "input_ids": prompt,
                           "stream": True, **REQUEST, "sampling_params": {
                               "max_new_tokens": max_new_tokens, "temperature": 0.0,
                               "ignore_eos": ignore_eos}}).encode()
        req = urllib.request.Request(self.url + "/generate", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        ttft: float | None = None
        last: dict[str, Any] = {}
        stream = Streamed()
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - t0
                last = json.loads(line[5:])
                _refuse_failed(self.url, last)
                try:
                    stream.add(last)
                except ValueError as e:
                    raise RunError(f"{self.url}/generate: {e}") from None
        total = time.perf_counter() - t0
        meta = last.get("meta_info") or {}
        try:
            answer = stream.answer()
        except ValueError as e:
            raise RunError(f"{self.url}/generate: {e}") from None
        return Reply(text=str(last.get("text", "")), output_ids=stream.ids,
                     prompt_tokens=int(meta.get("prompt_tokens", 0)),
                     cached_tokens=int(meta.get("cached_tokens", 0)),
                     details=dict(meta.get("cached_tokens_details") or {}),
                     ttft_s=ttft if ttft is not None else total, total_s=total,
                     answer=answer)

    def flush_l1_l2(self, timeout: float = 60.0) -> None:
        """SGLang's /flush_cache: L1 and L2 emptied, L3 kept. SGLang answers 400 while its
        scheduler is not yet idle (the last batch of a finished request is cleared on its next
        loop turn, late on a loaded box), so it is asked again until done or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while True:
            req = urllib.request.Request(self.url + "/flush_cache", data=b"", method="POST")
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    r.read()
                return
            except urllib.error.HTTPError as e:
                if e.code != 400 or time.monotonic() > deadline:
                    raise
            time.sleep(0.5)

    def get(self, path: str, timeout: float = 30.0) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.read().decode()

    def _pid_reused(self) -> bool:
        """The launch exited (reaped here) and a live process holds its PID: the group that PID
        leads now is someone else's (while the old group had members, the PID was not free)."""
        if self.proc is None or self.proc.returncode is None:
            return False
        try:
            os.kill(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def _signal(self, sig: int) -> None:
        if self.proc is None or self._pid_reused():
            return
        try:
            os.killpg(self.proc.pid, sig)        # the group launch's PID leads (its own session)
        except ProcessLookupError:
            pass

    def _group_alive(self) -> bool:
        if self.proc is None or self._pid_reused():
            return False
        members = group_members(self.proc.pid)    # zombies left unreaped by init do not count
        if members is not None:
            return bool(members)
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def _only_helpers_beside_leader(self) -> bool | None:
        """Whether every other live process of the group is one that outlives its leader (none
        at all included); None where the group is not known (`group_members`)."""
        assert self.proc is not None
        others = group_members(self.proc.pid, but=self.proc.pid)
        return None if others is None else all(outlives_its_leader(p) for p in others)

    def stop(self, grace: float = 30.0) -> int:
        """SIGTERM the server's process group, SIGKILL what is left after `grace` s; the group's
        leader is killed at once when all that is left beside it is what waits for it to exit
        (`outlives_its_leader`): SGLang's main process takes its scheduler's exit on the SIGTERM
        for a crash and sleeps 5 s "before crash diagnostics", with nothing of the tier left to
        finish (the backend lives in the scheduler, which has exited). The launch process's exit
        status (0 for a server this process did not start)."""
        if self.proc is None:
            return 0
        shortcut = self._only_helpers_beside_leader() is False    # a child (the scheduler) to wait for
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (self.proc.poll() is None or self._group_alive()):
            if shortcut and self.proc.poll() is None and self._only_helpers_beside_leader():
                self.proc.kill()                # the leader only: its helpers then exit by themselves
            time.sleep(0.2)
        self._signal(signal.SIGKILL)
        return self.proc.wait()

    def kill(self) -> int:
        """SIGKILL the whole group at once (a crash: nothing gets to flush)."""
        self._signal(signal.SIGKILL)
        return self.proc.wait() if self.proc is not None else 0
