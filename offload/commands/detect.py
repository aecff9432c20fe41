"""`sglang-offload detect [--root DIR] [--cache-dir PATH] [--config FILE] [--python EXE] [--json]
[--probe-io]`.

Prints the hardware report and the transfer-path decision (or, with `--json`, one object that
follows offload/hw/schema.json). Exit codes: 0 decided; 1 the config asks for a path that cannot
work here (the report says which check failed); 2 bad input (missing/unreadable root, bad config,
or what would fail at start: `offload.hw.host_checks`, every problem one `error:` line). A Redis
or agent that does not accept a connection is a `warning:` line naming its address; so is each
problem of a configured cache directory (`drive_set.choose_drives`: two on one device, one on a
system file system, on another socket, on a drive the cache should not use), after the report's
Drives table (which drives the cache would use and why) and the combined read bandwidth.
With `--root` other than `/`, every machine path (the cache directory too) is inside the root and
the live probes (NVML, libcufile, mlxconfig, the agent connection, `--probe-io`) are not run. The
Python side of each path is asked of `--python` (default this interpreter) under any root.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys

from offload.config import OffloadConfig, load_file
from offload.errors import ConfigError, DetectError
from offload.hw.decide import PathRejectedError, decide
from offload.hw.detect import detect
from offload.hw.drive_set import choose_drives, one_per_device
from offload.hw.facts import IoProbe
from offload.hw.fsroot import Root
from offload.hw.live import NOT_CHECKED, connect
from offload.hw.report import render_text, to_json
from offload.launch.checks import machine_findings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", default="/", metavar="DIR",
                   help="read the machine under DIR (a fixture tree); default /")
    p.add_argument("--cache-dir", metavar="PATH",
                   help="cache directory to judge (default: every directory of the config: "
                   "offload.store.paths, or offload.store.path)")
    p.add_argument("--config", metavar="FILE", help="deployment config (YAML) with offload:")
    p.add_argument("--python", default=sys.executable, metavar="EXE",
                   help="interpreter that runs SGLang, whose Python side of each path is checked "
                   "(default: this one)")
    p.add_argument("--json", action="store_true", help="print one JSON object (schema.json)")
    p.add_argument("--probe-io", action="store_true",
                   help="measure O_DIRECT write/read in the cache directory for a few seconds "
                   "(several directories: one per distinct device, all at once, rates summed)")
    p.add_argument("--probe-io-seconds", type=float, default=4.0, metavar="S",
                   help="time budget of --probe-io (write + read); default 4")


def _python(exe: str) -> None:
    """--python must name an interpreter that runs (else every path's Python side would read
    as missing and detect would exit 0)."""
    found = shutil.which(exe) if os.sep not in exe else exe
    if not found or not os.path.isfile(found) or not os.access(found, os.X_OK):
        raise ConfigError([f"--python {exe}: no such executable; name the interpreter that runs "
                           "SGLang (e.g. /opt/venv/bin/python), or leave --python out for this "
                           "one"])


def run(args: argparse.Namespace) -> int:
    cfg = load_file(args.config).offload if args.config else OffloadConfig()
    if args.cache_dir and not args.cache_dir.startswith("/") and args.root not in ("/", ""):
        raise DetectError(f"--cache-dir {args.cache_dir!r}: give an absolute path inside the root "
                          f"{args.root!r}")
    _python(args.python)
    root = Root(args.root)
    facts = detect(cfg, root=args.root, cache_dir=args.cache_dir, python=args.python)
    found = machine_findings(cfg, facts, root, args.cache_dir, connect)   # launch's list too
    if found.errors:
        for line in found.errors:
            print(f"error: {line}", file=sys.stderr)
        return 2
    warnings = list(found.warnings)
    if args.probe_io:
        dirs = [cd.path for cd in one_per_device(list(facts.directories))]
        if facts.live:
            from offload.hw.probe_io import probe_io_many

            io = probe_io_many(dirs, seconds=max(args.probe_io_seconds, 0.05))
        else:
            io = IoProbe(path=", ".join(dirs), bytes=0, write_gbps=None, read_gbps=None,
                         o_direct=False, source=NOT_CHECKED,
                         reason=f"{NOT_CHECKED} (fixture root: nothing is written there)")
        facts = dataclasses.replace(facts, io=io)
    decision, error = None, None
    try:
        decision = decide(facts, cfg)
    except PathRejectedError as e:
        error = e
    drives = choose_drives(facts, cfg)
    if args.json:
        json.dump(to_json(facts, decision, error, drives), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_text(facts, decision, error, drives))
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
