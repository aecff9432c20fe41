"""The `sglang-offload` command.

Each sub-command lives in its own module, imported only when that command runs (so `detect` never
pays for the block store, and `--help` loads nothing heavy). A command module exposes
`add_arguments(parser)` and `run(args) -> int`.

One error path for every command (`main`): a bad option value is argparse's `error:` line (the
option types in `offload.argtypes` check values while parsing, before any work); a typed
error (`offload.errors`) is one `error:` line per problem with its exit code; an OSError names
the file; anything else is one `error: internal error` line (`-v` logs its traceback). A closed
stdout (`... | head`) ends the command quietly. Exit codes: 0 ok, 1 a check failed or the run
could not complete, 2 bad input, 130 interrupted, 141 stdout closed by the reader.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import select
import sys
import time

from offload import redact
from offload.errors import ConfigError, OffloadError

log = logging.getLogger("offload.cli")

# name -> (module, one-line help). A duplicate name is a programming error caught at import.
COMMANDS: dict[str, tuple[str, str]] = {
    "config": ("offload.commands.config", "validate a config file and print the effective config"),
    "bench": ("offload.commands.bench", "measure the tier on this machine"),
    "detect": ("offload.commands.detect", "inspect the hardware and decide the transfer path"),
    "plan": ("offload.commands.plan", "KV-cache sizing: bytes per user, users per GPU with/without offload"),
    "cache": ("offload.commands.cache", "inspect and maintain a cache directory"),
    "agent": ("offload.commands.agent", "run the storage agent (on a BlueField DPU or storage host)"),
    "launch": ("offload.commands.launch", "validate a deployment config and exec SGLang with the tier"),
    "demo-model": ("offload.commands.demo_model",
                   "write a small real instruct model (SmolLM2-135M) to serve on a CPU box, or "
                   "--random weights for fast tests"),
    "events": ("offload.commands.events",
               "how much of a prompt's prefix each server holds per tier (KV events)"),
}
EXIT_PIPE = 141      # as a process killed by SIGPIPE, what a shell reports for `yes | head -1`


def version() -> str:
    """`sglang-offload --version`: ours, and the SGLang this interpreter has (its local version
    names the patched build: `0.5.23+offload.N`) against the release launch composes for."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    from offload.launch.interpreter import pinned

    try:
        sglang = dist_version("sglang")
    except PackageNotFoundError:
        sglang = "not installed"
    want, ours = pinned()
    return f"sglang-offload {ours} (SGLang {sglang}; launch composes for SGLang {want})"


class _Version(argparse.Action):
    """--version, computed only when asked (it reads package metadata)."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(version())
        parser.exit()


def _unknown(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> None:
    """Refuse arguments no parser took; for launch, say where SGLang's own flags go."""
    if args.command != "launch":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    flags = " ".join([*extra, *(getattr(args, "sglang_args", None) or [])])
    raise ConfigError([f"launch: unrecognized arguments: {' '.join(extra)}; SGLang's own flags "
                       "go after `--`, e.g. sglang-offload launch --config "
                       f"{getattr(args, 'config', None) or 'FILE'} -- {flags}"])


def _parser(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="sglang-offload", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="print the version of sglang-offload and of its SGLang, and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only the chosen command's module is imported.
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    args, extra = parser.parse_known_args(argv)
    if extra:
        _unknown(parser, args, extra)
    return parser, args


def _errors(lines: str) -> None:
    for line in lines.splitlines() or [""]:
        print(f"error: {line}", file=sys.stderr)


def _stdout_closed() -> bool:
    """Whether stdout's reader went away (a BrokenPipeError may also come from another pipe)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0))
    except (OSError, ValueError, AttributeError):   # stdout without a file descriptor (tests)
        return True


def _quiet_stdout() -> int:
    """Stop writing to a closed stdout, and let nothing flush into it at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):   # stdout without a file descriptor (tests)
        pass
    return EXIT_PIPE


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = "-v" in argv[:1] or "--verbose" in argv[:1]
    try:
        parser, args = _parser(argv)
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        if args.verbose:         # ours only: a library's debug lines (matplotlib's font search,
            logging.getLogger("offload").setLevel(logging.DEBUG)   # redis-py's) would bury them
        if not args.command:
            parser.print_help()
            return 2
        module = importlib.import_module(COMMANDS[args.command][0])
        given = sorted(k for k, v in vars(args).items()
                       if k not in ("command", "verbose") and v not in (None, False, [], ""))
        log.debug("%s (%s), options given: %s", args.command, module.__name__,
                  ", ".join(given) or "none")          # names only: values may be secrets
        t0 = time.monotonic()
        rc = int(module.run(args) or 0)
        sys.stdout.flush()       # a closed pipe shows here, inside the handler, not at exit
        log.debug("%s: exit %d after %.2f s", args.command, rc, time.monotonic() - t0)
        return rc
    except SystemExit as e:      # argparse: --help (0) or a bad option (2, its message printed)
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        _errors(str(e.code))     # sys.exit("message")
        return 1
    except BrokenPipeError as e:
        if _stdout_closed():
            return _quiet_stdout()
        _errors(f"{e.filename or 'a pipe'}: {e.strerror or e}")
        return 1
    except OffloadError as e:
        _errors(str(e))
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except OSError as e:         # a file or socket the command needed, named with the reason
        log.debug("traceback", exc_info=True)
        where = f"{e.filename}: " if e.filename else ""
        _errors(redact.text(f"{where}{e.strerror or e}"))
        return 1
    except Exception as e:       # a bug: one line; -v logs the traceback for the report
        log.debug("traceback", exc_info=True)
        _errors(f"internal error: {type(e).__name__}: {redact.text(str(e))}"
                + ("" if verbose else " (run with -v for the traceback and report it)"))
        return 1


if __name__ == "__main__":
    sys.exit(main())
