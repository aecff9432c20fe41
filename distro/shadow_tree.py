"""The patched SGLang with some patches left out, as a directory that shadows the installed one.

    .venv/bin/python distro/shadow_tree.py --without 0008 --out /tmp/sglang-no-0008
    PYTHONPATH=/tmp/sglang-no-0008 sglang-offload bench serve --config configs/cpu-dev.yaml ...

For before/after measurements of one patch in the same session: the pinned upstream wheel is
unpacked into `--out` and patches/series is applied without the patches named by `--without`
(by number or file-name prefix). Put the directory first on PYTHONPATH and every process started
from that shell, SGLang's servers included, imports that SGLang instead of `.venv`'s; nothing
installed changes. Its `.dist-info` records the patches applied (OFFLOAD_PATCHES, as the wheel
does), so `bench serve` names what the server runs. A script like build_wheel.py, loaded by path:
nothing under distro/ is importable.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _build_wheel():
    name = "sglang_offload_build_wheel"
    if name not in sys.modules:   # registered first: its dataclasses look their module up
        spec = importlib.util.spec_from_file_location(name, HERE / "build_wheel.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def select(series: list[Path], without: list[str]) -> list[Path]:
    """The series less the patches `without` names; every name must match exactly one patch."""
    kept = list(series)
    for name in without:
        hits = [p for p in series if p.name.startswith(name)]
        if len(hits) != 1:
            names = ", ".join(p.name[:4] for p in series)
            raise ValueError(f"--without {name!r} matches {len(hits)} patches of patches/series "
                             f"(one wanted; the series: {names})")
        kept.remove(hits[0])
    return kept


def build(out: Path, without: list[str], bw=None) -> list[Path]:
    """Unpack the pinned wheel into `out` with the series less `without`; the patches applied."""
    bw = bw or _build_wheel()
    patches = select(bw.read_series(), without)
    pin = bw.load_pin()
    wheel = bw.fetch_wheel(pin, bw.pick_wheel(pin))
    if out.exists():
        if not (out / "sglang").is_dir():
            raise ValueError(f"--out {out} exists and is not a tree this script made (no sglang/)")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    bw.patch_tree(wheel, out, patches)
    info = [d for d in out.glob("sglang-*.dist-info") if d.is_dir()]
    if len(info) != 1:
        raise bw.BuildError(f"{wheel.name} unpacked {len(info)} sglang .dist-info directories")
    (info[0] / bw.PATCHES_RECORD).write_bytes(bw.patches_record(patches))
    return patches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--without", action="append", required=True, metavar="PATCH",
                        help="a patch to leave out, by number or file-name prefix (repeatable)")
    parser.add_argument("--out", type=Path, required=True, help="the directory to write (replaced)")
    args = parser.parse_args(argv)
    bw = _build_wheel()
    try:
        patches = build(args.out.resolve(), args.without, bw)
    except (ValueError, OSError, bw.BuildError) as err:
        print(f"shadow_tree: {err}", file=sys.stderr)
        return 2
    print(f"shadow_tree: {args.out} holds SGLang with {len(patches)} patches "
          f"(without {', '.join(args.without)}); use PYTHONPATH={args.out}", file=sys.stderr)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
