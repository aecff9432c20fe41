"""The `sglang-offload` command.

Each sub-command lives in its own module, imported only when that command runs (so `detect` never
pays for the block store, and `--help` loads nothing heavy). A command module exposes
`add_arguments(parser)` and `run(args) -> int`. Exit codes: 0 ok, 1 a check failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from offload.errors import OffloadError

# name -> (module, one-line help). A duplicate name is a programming error caught at import.
COMMANDS: dict[str, tuple[str, str]] = {
    "config": ("offload.commands.config", "validate a config file and print the effective config"),
    "bench": ("offload.commands.bench", "measure the tier on this machine"),
    "detect": ("offload.commands.detect", "inspect the hardware and decide the transfer path"),
    "plan": ("offload.commands.plan", "KV-cache sizing: bytes per user, users per GPU with/without offload"),
    "cache": ("offload.commands.cache", "inspect and maintain a cache directory"),
    "agent": ("offload.commands.agent", "run the storage agent (on a BlueField DPU or storage host)"),
    "launch": ("offload.commands.launch", "validate a deployment config and exec SGLang with the tier"),
}


def _parser(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="sglang-offload", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only the chosen command's module is imported.
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    return parser, parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, args = _parser(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.command:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except OffloadError as e:
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
