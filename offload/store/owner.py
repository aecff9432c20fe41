"""Who owns a pending slot: a process identity that survives pid reuse and reboots.

A writer's pending index rows carry its token (boot id : pid : process start time); a row whose
owner is not alive (another boot, no such pid, or a pid reused by a newer process) belongs to a
writer that died mid-put, and its slot is reclaimed.

Primitives: `owner_token(pid=None)`, `owner_alive(token)`.
"""

from __future__ import annotations

import os


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def _start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def owner_token(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{_boot_id()}:{pid}:{_start_time(pid)}"


def owner_alive(token: str | None) -> bool:
    if not token:
        return False
    boot, pid, start = (token.split(":") + ["", "", ""])[:3]
    if boot != _boot_id() or not pid.isdigit():
        return False
    return _start_time(int(pid)) == start and start != ""


__all__ = ["owner_alive", "owner_token"]
