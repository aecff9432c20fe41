"""Resolve every transfer path's Python dependencies as wheels, for the image's build stage.

    python3 distro/path_wheels.py --cuda-major 13 --out /wheels

The paths' libraries are pyproject.toml's extras `gds-cu<N>` (kvikio for BASE's CUDA major),
`dpu` (NIXL, msgspec), `redis` (redis-py) and `metrics` (prometheus-client). Steps:
  requirements()  those extras, read from pyproject.toml
  check_cuda()    BASE's torch must be built for CUDA <N> (read off torch/version.py, not imported)
  resolve()       `pip install --dry-run --report` against BASE's own environment: what BASE already
                  holds at a compatible version is not in the report, so it is reused, not reinstalled
  keep()          the report's packages reachable from the requirements without passing through
                  SKIP: kvikio's cupy (its array helpers; our gds path hands kvikio torch tensors),
                  torch (NIXL's declared requirement: BASE's own torch runs SGLang) and NIXL's
                  backend for the other CUDA major
  fetch()         `pip wheel --no-deps` of exactly those pins into --out
The runtime stage installs the result with `pip install --no-deps --no-index`: no compiler there.
A script, not a package (like build_wheel.py): `distro` is the name of a PyPI package SGLang needs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

EXTRAS = ("gds-cu{major}", "dpu", "redis", "metrics")


class BuildError(Exception):
    pass


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def skip_reason(name: str, major: int) -> str | None:
    n = canon(name)
    if re.fullmatch(r"cupy-cuda\d+x", n):
        return "kvikio's array helpers; the gds path hands kvikio torch tensors"
    if n == "torch":
        return "BASE's own torch runs SGLang"
    m = re.fullmatch(r"nixl-cu(\d+)", n)
    if m and int(m.group(1)) != major:
        return f"NIXL's backend for CUDA {m.group(1)}; BASE is CUDA {major}"
    return None


def requirements(pyproject: Path, major: int) -> list[str]:
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    out: list[str] = []
    for e in EXTRAS:
        name = e.format(major=major)
        if name not in extras:
            raise BuildError(f"pyproject.toml has no extra {name!r} (CUDA_MAJOR={major}?)")
        out += extras[name]
    return out


def torch_cuda(python: str) -> str | None:
    """torch.version.cuda of `python`'s torch, read off disk (None: no torch or a CPU build)."""
    code = ("import importlib.util as u, os, re\n"
            "s = u.find_spec('torch')\n"
            "for loc in (s.submodule_search_locations or []) if s else []:\n"
            "    f = os.path.join(loc, 'version.py')\n"
            "    if os.path.isfile(f):\n"
            "        t = open(f).read()\n"
            "        m = re.search(r\"^cuda\\s*(?::[^=\\n]*)?=\\s*['\\\"]([^'\\\"]+)\", t, re.M)\n"
            "        print(m.group(1) if m else '')\n"
            "        break\n")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout
    return out.strip() or None


def check_cuda(python: str, major: int) -> str:
    cuda = torch_cuda(python)
    if cuda is None:
        return f"BASE has no CUDA torch: CUDA_MAJOR={major} taken as given"
    if int(cuda.split(".")[0]) != major:
        raise BuildError(f"CUDA_MAJOR={major} but BASE's torch is built for CUDA {cuda}: build with "
                         f"--build-arg CUDA_MAJOR={cuda.split('.')[0]}")
    return f"BASE's torch is built for CUDA {cuda}"


def resolve(python: str, reqs: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        res = subprocess.run([python, "-m", "pip", "install", "--dry-run", "--quiet",
                              "--only-binary", ":all:", "--report", str(report), *reqs],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise BuildError(f"pip could not resolve {reqs}:\n{res.stderr[-3000:]}")
        return json.loads(report.read_text()).get("install", [])


def keep(items: list[dict], reqs: list[str], major: int) -> tuple[list[dict], dict[str, str]]:
    """(items reachable from reqs avoiding SKIP, {skipped name: why})."""
    try:
        from packaging.requirements import Requirement
    except ImportError:       # a bare base: pip's own copy (importing pip in a process that later
        from pip._vendor.packaging.requirements import Requirement  # builds torch extensions
        #                                                 upsets setuptools' distutils shim)

    by = {canon(i["metadata"]["name"]): i for i in items}
    todo = [(Requirement(r), frozenset(Requirement(r).extras)) for r in reqs]
    seen: set[str] = set()
    skipped: dict[str, str] = {}
    while todo:
        req, extras = todo.pop()
        name = canon(req.name)
        why = skip_reason(name, major)
        if why:
            skipped[name] = why
            continue
        if name in seen or name not in by:          # not in the report: BASE already holds it
            continue
        seen.add(name)
        for dep in by[name]["metadata"].get("requires_dist", []):
            d = Requirement(dep)
            env_extras = extras or frozenset({""})
            if d.marker is not None and not any(d.marker.evaluate({"extra": e}) for e in env_extras):
                continue
            todo.append((d, frozenset(d.extras)))
    return [by[n] for n in sorted(seen)], skipped


def fetch(python: str, items: list[dict], out: Path) -> None:
    pins = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in items]
    if pins:
        subprocess.run([python, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir",
                        str(out), *pins], check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cuda-major", type=int, required=True, help="BASE's CUDA major (13, 12)")
    p.add_argument("--out", type=Path, required=True, help="wheel directory")
    p.add_argument("--pyproject", type=Path, default=Path(__file__).resolve().parents[1]
                   / "pyproject.toml")
    p.add_argument("--python", default=sys.executable, help="BASE's interpreter (default this)")
    args = p.parse_args(argv)
    try:
        reqs = requirements(args.pyproject, args.cuda_major)
        print(f"path_wheels: {check_cuda(args.python, args.cuda_major)}")
        items, skipped = keep(resolve(args.python, reqs), reqs, args.cuda_major)
        args.out.mkdir(parents=True, exist_ok=True)
        fetch(args.python, items, args.out)
    except (BuildError, subprocess.CalledProcessError) as e:
        print(f"path_wheels: error: {e}", file=sys.stderr)
        return 1
    print(f"path_wheels: requirements {', '.join(reqs)}")
    print("path_wheels: wheels " + (", ".join(f"{i['metadata']['name']} {i['metadata']['version']}"
                                              for i in items) or "none (BASE holds them all)"))
    for name, why in sorted(skipped.items()):
        print(f"path_wheels: not installed: {name} ({why})")
    return 0


if __name__ == "__main__" and importlib.util.find_spec("pip") is not None:
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    sys.exit(main())
