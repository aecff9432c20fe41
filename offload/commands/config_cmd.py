"""`sglang-offload config validate FILE`: print the effective config (exit 0) or every error (exit 2)."""

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


def run(args: argparse.Namespace) -> int:
    try:
        dep = load_file(args.file)
    except ConfigError as e:
        for line in e.problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    out = {"offload": to_dict(dep.offload), "sglang": dict(dep.sglang)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(yaml.safe_dump(out, sort_keys=False), end="")
    return 0
