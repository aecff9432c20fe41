"""The interpreter that will run SGLang (`launch --python EXE`): does it have our SGLang and us?

`check_interpreter(exe) -> Interpreter` asks EXE (a child process: `importlib.util.find_spec` and
`importlib.metadata`, nothing imported, the working directory left out of its path) for `sglang`
and `offload` and judges them against the pins: SGLang's release is the one launch checks the
arguments for (the parser snapshot's, `offload/launch/sglang_args.json`), sglang-offload's is
this package's own. `Interpreter.problem` is None when both match, else one line naming what is
wrong and the fix. `Interpreter.note`: what was found (shown by the dry run).
Never raises: an interpreter that does not run is a problem line.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from offload.launch.argspec import SNAPSHOT

PROBE = r"""
import importlib.metadata as m, importlib.util as u, json, os, sys
sys.path[:] = [p for p in sys.path if p not in ("", ".", os.getcwd())]
out = {}
for name, dist in (("sglang", "sglang"), ("offload", "sglang-offload")):
    try:
        found = u.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    try:
        v = m.version(dist)
    except m.PackageNotFoundError:
        v = None
    out[name] = {"found": found, "version": v}
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Interpreter:
    executable: str
    sglang: str | None          # installed version, None when missing
    offload: str | None
    problem: str | None         # one line with the fix, None when both match the pins
    note: str


def pinned() -> tuple[str, str]:
    """(SGLang release, sglang-offload version) that launch composes the command for."""
    sglang = json.loads(SNAPSHOT.read_text())["sglang_version"]
    try:
        ours = version("sglang-offload")
    except PackageNotFoundError:        # a source tree on PYTHONPATH without metadata
        ours = "unknown"
    return sglang, ours


def _ask(exe: str, timeout: float) -> tuple[dict[str, dict[str, object]] | None, str]:
    try:
        p = subprocess.run([exe, "-c", PROBE], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{exe} did not run: {e}"
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"{exe} -c <probe> exited {p.returncode}: {tail}"
    try:
        data = json.loads(p.stdout.strip().splitlines()[-1])
        if not isinstance(data, dict):
            raise ValueError("not an object")
        return data, ""
    except (ValueError, IndexError) as e:
        return None, f"{exe}: unreadable probe output ({e})"


def _found(data: dict[str, dict[str, object]], name: str) -> str | None:
    entry = data.get(name) or {}
    if not entry.get("found"):
        return None
    v = entry.get("version")
    return str(v) if v else "(no package metadata)"


def check_interpreter(exe: str, timeout: float = 30.0) -> Interpreter:
    """What `exe` imports of SGLang and sglang-offload, judged against the pins."""
    want_sglang, want_ours = pinned()
    from offload.hw.pyside import checkout

    top = checkout()
    fix = (f"install both into it as docs/install.md does (`{exe} -m pip install -e "
           f"'{top}[sglang]'`, then the patched SGLang wheel: `{exe} {top}/distro/"
           "install_patched.py`) or pass --python EXE: the interpreter that has both")
    data, why = _ask(exe, timeout)
    if data is None:
        return Interpreter(exe, None, None, f"--python {exe}: cannot ask it what it imports: "
                           f"{why}; {fix}", why)
    sg, ours = _found(data, "sglang"), _found(data, "offload")
    note = (f"--python {exe}: sglang {sg or 'missing'}, sglang-offload {ours or 'missing'} "
            f"(pinned: SGLang {want_sglang}, sglang-offload {want_ours})")
    missing = [f"{n} {w}" for n, got, w in (("sglang", sg, want_sglang),
                                             ("sglang-offload", ours, want_ours)) if got is None]
    if missing:
        return Interpreter(exe, sg, ours, f"--python {exe} cannot import {' and '.join(missing)}"
                           f"; {fix}", note)
    wrong = [f"{n} {got} (pinned {w})" for n, got, w in
             (("sglang", sg, want_sglang), ("sglang-offload", ours, want_ours))
             if got and got.split("+")[0] != w and w != "unknown"]
    if wrong:
        return Interpreter(exe, sg, ours, f"--python {exe} has {' and '.join(wrong)}; launch "
                           f"composes the command for the pinned versions; {fix}", note)
    return Interpreter(exe, sg, ours, None, note)
