"""Build and run the image without a Docker engine: Debian's buildah, chroot isolation, a local
stand-in for the SGLang base image (README, "Testing the image without Docker").

`ensure_base_tar()` makes the stand-in once (debootstrap minbase + python3, pip and the few
SGLang dependencies our tier imports; no torch) and caches it as BASE_TAR outside the repo.
`Buildah(workdir)` runs buildah with its own storage under `workdir` (removed by `remove()`).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
from pathlib import Path

CACHE_DIR = Path("/var/cache/sglang-offload-test")
BASE_TAR = CACHE_DIR / "base.tar"
SUITE = "bookworm"
# python3 + pip for the build stage; yaml/numpy/tqdm/xxhash: SGLang dependencies our package
# imports (the real base has all of SGLang's); ca-certificates: pip over HTTPS.
PACKAGES = ["python3", "python3-pip", "python3-venv", "python3-yaml", "python3-numpy",
            "python3-tqdm", "python3-xxhash", "ca-certificates"]
# Test-only: the build's pip trusts what this machine trusts (a re-signing proxy). Never baked in.
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"


def tools_missing() -> str | None:
    for tool in ("buildah", "debootstrap"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (apt-get install buildah debootstrap)"
    if os.geteuid() != 0:
        return "needs root (debootstrap, buildah chroot isolation)"
    return None


def debian_mirror() -> str:
    for path in ("/etc/apt/sources.list.d/debian.sources", "/etc/apt/sources.list"):
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        m = re.search(r"(?:URIs:\s*|^deb\s+)(\S+/debian)\b", text, re.M)
        if m:
            return m.group(1)
    return "http://deb.debian.org/debian"


def ensure_base_tar() -> Path:
    """The stand-in base rootfs as a tar (built once, then reused)."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # one builder at a time; the others reuse it
        if not BASE_TAR.is_file():
            _build_base_tar()
    return BASE_TAR


def _build_base_tar() -> None:
    rootfs = CACHE_DIR / "rootfs.tmp"
    shutil.rmtree(rootfs, ignore_errors=True)
    try:
        res = subprocess.run(["debootstrap", "--variant=minbase",
                              f"--include={','.join(PACKAGES)}", SUITE, str(rootfs),
                              debian_mirror()], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"debootstrap failed ({res.returncode}): {res.stderr[-2000:]}"
                               f"{res.stdout[-2000:]}")
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (rootfs / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        tmp = BASE_TAR.with_suffix(".tmp")
        subprocess.run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(tmp), "."],
                       check=True)
        tmp.rename(BASE_TAR)
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)


class Buildah:
    """buildah with private storage (overlay) under `workdir` and chroot isolation."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.common = ["--root", str(workdir / "root"), "--runroot", str(workdir / "runroot"),
                       "--storage-driver", "overlay"]

    def __call__(self, *args: str, timeout: float = 600, check: bool = True,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(["buildah", *self.common, *args], capture_output=True, text=True,
                             timeout=timeout, env={**os.environ, "BUILDAH_ISOLATION": "chroot",
                                                   **(env or {})})
        if check and res.returncode != 0:
            raise AssertionError(f"buildah {' '.join(args[:3])} failed ({res.returncode}):\n"
                                 f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        return res

    def import_base(self, tar: Path, name: str) -> None:
        ctr = self("from", "scratch").stdout.strip()
        self("add", ctr, str(tar), "/")
        self("config", "--cmd", "/bin/bash", "--env",
             "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", ctr)
        self("commit", "--format", "docker", ctr, name)
        self("rm", ctr)

    def remove(self) -> None:
        subprocess.run(["buildah", *self.common, "rm", "--all"], capture_output=True)
        subprocess.run(["buildah", *self.common, "rmi", "--all", "--force"], capture_output=True)
        # overlay storage may leave mounts behind; unmount before deleting
        subprocess.run(["umount", "-R", str(self.workdir / "root" / "overlay")],
                       capture_output=True)
        shutil.rmtree(self.workdir, ignore_errors=True)
