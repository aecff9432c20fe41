"""`sglang-offload config validate FILE`: check the whole deployment file.

The `offload:` section is validated by offload.config, then against this machine by
offload.hw.host_checks (NUMA node, cache directory, secret files: what would fail at start); the
`sglang:` section (when present) by SGLang's own argument parser of the pinned release plus the
combination rules of `launch` (offload.launch.sglang_args). Prints the effective config with its
secrets as `***` (exit 0; warnings on stderr) or every error, one `error:` line each (exit 2).
`--offload-only` skips the sglang: checks. `--offline` checks the file alone, not this machine:
no secret, salt or TLS file is read, no NUMA node or cache directory looked at (CI, a laptop).
The file itself is always checked, offline too: one holding a secret must be mode 600.
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from offload import redact
from offload.config import ConfigError, load_file, to_dict


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    v = sub.add_parser("validate", help="validate FILE; print the effective config (secrets as "
                       "***) or every error")
    v.add_argument("file")
    v.add_argument("--json", action="store_true", help="print the effective config as JSON")
    v.add_argument("--offload-only", action="store_true",
                   help="check only the offload: section (not the sglang: one)")
    v.add_argument("--offline", action="store_true",
                   help="check the file alone, not this machine: no secret or TLS file is read, "
                   "no NUMA node or cache directory looked at (CI, a laptop)")


def run(args: argparse.Namespace) -> int:
    from offload.hw.host_checks import check_host
    from offload.launch.checks import salt_file_errors

    warnings: list[str] = []
    problems: list[str] = []
    try:
        dep = load_file(args.file)
    except ConfigError as e:
        problems = e.problems
    else:
        if dep.sglang and not args.offload_only:
            from offload.launch.sglang_args import check_sglang

            try:
                warnings = check_sglang(dep.sglang, [], dep.offload).warnings
            except ConfigError as e:
                problems += e.problems
        if not args.offline:
            problems += [*check_host(dep.offload).errors, *salt_file_errors(dep.offload)]
    if problems:
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    out = {"offload": redact.tree("offload", to_dict(dep.offload)),
           "sglang": redact.tree("sglang", dep.sglang)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(yaml.safe_dump(out, sort_keys=False), end="")
    return 0
