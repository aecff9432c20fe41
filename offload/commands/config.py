"""`sglang-offload config validate FILE`: check the whole deployment file.

The `offload:` section is validated by offload.config; the `sglang:` section (when present) by
SGLang's own argument parser of the pinned release plus the combination rules of `launch`
(offload.launch.sglang_args). Prints the effective config (exit 0; warnings on stderr) or every
error, one `error:` line each (exit 2). `--offload-only` skips the sglang: checks (and SGLang's
import, which takes seconds).
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from offload.config import ConfigError, load_file, to_dict


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    v = sub.add_parser("validate", help="validate FILE; print the effective config or the errors")
    v.add_argument("file")
    v.add_argument("--json", action="store_true", help="print the effective config as JSON")
    v.add_argument("--offload-only", action="store_true",
                   help="check only the offload: section (no SGLang import)")


def run(args: argparse.Namespace) -> int:
    warnings: list[str] = []
    try:
        dep = load_file(args.file)
        if dep.sglang and not args.offload_only:
            from offload.launch.sglang_args import check_sglang

            warnings = check_sglang(dep.sglang, [], dep.offload).warnings
    except ConfigError as e:
        for line in e.problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    out = {"offload": to_dict(dep.offload), "sglang": dict(dep.sglang)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(yaml.safe_dump(out, sort_keys=False), end="")
    return 0
