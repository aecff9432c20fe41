"""`sglang-offload launch --config FILE [--dry-run] [--json] [--root DIR] [-- SGLANG FLAGS]`.

The steps are `offload.launch.compose.prepare`; this module parses the command line, prints the
dry run (secrets redacted, nothing written), or prints its decision (`compose.summary`: path and
why, store, tiers, device choices) to stderr, checks what SGLang's page-hash extension needs
(`offload.launch.prebuild`: exit 1 naming a missing ninja or compiler), writes the settings file
(`compose.write`: 0600, private runtime directory) and replaces this process with SGLang
(`os.execvpe`, with the device's environment: signals reach SGLang directly).
Exit codes: 0 ok, 1 the requested path cannot work here, 2 bad config or flags.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from offload.errors import ConfigError, OffloadError
from offload.launch.compose import all_warnings, prepare, render, summary, to_json, write


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="FILE",
                   help="deployment YAML with sglang: and offload: sections")
    p.add_argument("--dry-run", action="store_true",
                   help="print the decision, the effective config and the command; do not start")
    p.add_argument("--json", action="store_true", help="with --dry-run: one JSON object")
    p.add_argument("--root", default="/", metavar="DIR",
                   help="detect from the machine under DIR (a fixture tree); default /")
    p.add_argument("--cache-dir", metavar="PATH",
                   help="cache directory to judge (default: offload.store.path)")
    p.add_argument("--python", default=sys.executable, metavar="EXE",
                   help="interpreter that runs SGLang (default: this one)")
    p.add_argument("sglang_args", nargs="*", metavar="-- SGLANG_FLAG",
                   help="extra SGLang flags after `--`, appended last (they win)")


def run(args: argparse.Namespace) -> int:
    from offload.hw import PathRejectedError
    from offload.launch.prebuild import check_native_hash

    if args.json and not args.dry_run:
        raise OffloadError("--json goes with --dry-run (without it, launch starts SGLang)")
    try:
        p = prepare(args.config, args.sglang_args, root=args.root, cache_dir=args.cache_dir,
                 python=args.python)
    except PathRejectedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if p.host_errors and not args.dry_run:          # what would fail at start
        raise ConfigError(p.host_errors)
    for w in all_warnings(p):      # the same list as --json's `warnings` (and detect's)
        print(f"warning: {w}", file=sys.stderr)
    if args.dry_run:
        if args.json:
            json.dump(to_json(p), sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            sys.stdout.write(render(p, args.config))
        return 0
    sys.stderr.write(summary(p, args.config))   # the decision, before SGLang's own logs
    # SGLang's L3 page hashes: built or loaded by the backend at start; the tools checked here
    sys.stderr.write(f"  {check_native_hash({**os.environ, **p.device.env})}\n")
    write(p)                      # the settings (with the secrets) go to a 0600 file, not argv
    sys.stdout.flush()
    sys.stderr.flush()
    # replaces this process: SGLang gets our PID and signals, and the device's environment
    os.execvpe(p.argv[0], p.argv, {**os.environ, **p.device.env})
    return 0  # pragma: no cover - execvp does not return
