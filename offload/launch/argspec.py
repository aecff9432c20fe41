"""SGLang's server-argument parser: the live one, or a snapshot of it when SGLang cannot import.

Primitives: `sglang_parser() -> (parser, source)` (cached per process), `snapshot(parser)` (the
parser as plain JSON data: every action's option strings, dest, kind, type name, choices, nargs,
default) and `parser_from_snapshot(data)`. Both parsers raise `ArgsRefused` instead of exiting.

The live parser is `ServerArgs.add_cli_args` of the installed SGLang (importing it takes seconds:
it loads torch). Where SGLang is not importable - a laptop with only sglang-offload, or an image
whose base lacks SGLang's dependencies - `offload/launch/sglang_args.json`, written from the pinned
release's own parser (`python -m offload.launch.argspec > offload/launch/sglang_args.json`) and checked
against it by tests/launch, stands in so `launch --dry-run` and `config validate` still check
every key, type and choice.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

SNAPSHOT = Path(__file__).resolve().parent / "sglang_args.json"


class ArgsRefused(Exception):
    """SGLang's parser refused the arguments (argparse's own message)."""


class RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse calls this instead of raising
        raise ArgsRefused(message)


def _human_readable_int(value: str) -> int:
    """SGLang's human_readable_int: 131072, 128k (SI, decimals allowed), 128Ki (IEC)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", value.strip())
    if m:
        si = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
        iec = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
        number, suffix = m.groups()
        if suffix in iec:
            if "." in number:
                raise ValueError("no decimals with IEC suffixes")
            return int(number) * iec[suffix]
        return int(float(number) * si[suffix])
    return int(value)


def _nullable_str(value: str) -> str | None:
    return None if not value or value == "None" else value


def _json(value: str) -> Any:
    return json.loads(value)


_TYPES: dict[str, Callable[[str], Any]] = {
    "int": int, "float": float, "str": str, "human_readable_int": _human_readable_int,
    "nullable_str": _nullable_str, "loads": _json, "json_list_type": _json}


def _kind(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "store_true"
    if isinstance(action, argparse.BooleanOptionalAction):
        return "boolean_optional"
    if isinstance(action, argparse._StoreAction):
        return "store"
    return "other"


def _plain(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool, list, type(None))) else None


def snapshot(parser: argparse.ArgumentParser, version: str) -> dict[str, Any]:
    """The parser as data (what parser_from_snapshot needs to rebuild it)."""
    actions = []
    for a in parser._actions:
        if not a.option_strings or a.dest == "help":
            continue
        actions.append({"options": list(a.option_strings), "dest": a.dest, "kind": _kind(a),
                        "type": getattr(a.type, "__name__", None) if a.type else None,
                        "choices": sorted(str(c) for c in a.choices) if a.choices else None,
                        "nargs": a.nargs if a.nargs != 0 else None, "required": a.required,
                        "default": _plain(a.default)})
    return {"sglang_version": version, "actions": actions}


def parser_from_snapshot(data: dict[str, Any]) -> RaisingParser:
    parser = RaisingParser(prog="sglang.launch_server", add_help=False)
    for a in data["actions"]:
        kw: dict[str, Any] = {"dest": a["dest"], "default": a["default"]}
        if a["kind"] == "store_true":
            kw["action"] = "store_true"
        elif a["kind"] == "boolean_optional":
            kw["action"] = argparse.BooleanOptionalAction
        elif a["kind"] == "store":
            kw.update(type=_TYPES.get(a["type"] or "str", str), nargs=a["nargs"],
                      required=a["required"])
            if a["choices"] is not None:
                kw["choices"] = a["choices"] if a["type"] != "int" else [
                    int(c) for c in a["choices"]]
        else:                     # SGLang's own custom actions: take one value
            kw.update(nargs=a["nargs"] or None)
        parser.add_argument(*a["options"], **kw)
    return parser


def live_parser() -> RaisingParser:
    from sglang.srt.server_args import ServerArgs

    parser = RaisingParser(prog="sglang.launch_server", add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser


def sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return json.loads(SNAPSHOT.read_text())["sglang_version"] + " (snapshot)"


def _installed_release() -> str | None:
    """The installed SGLang's release (`0.5.23` of `0.5.23+offload.3`), from its metadata only."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang").split("+")[0]
    except PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def sglang_parser() -> tuple[argparse.ArgumentParser, str]:
    """(parser, where it came from): the snapshot when the installed SGLang is the release it was
    taken from (tests/launch check it equals that release's live parser; importing SGLang's own
    takes seconds: torch), else SGLang's live parser, else the snapshot all the same."""
    data = json.loads(SNAPSHOT.read_text())
    if _installed_release() == data["sglang_version"]:
        return (parser_from_snapshot(data), f"snapshot of SGLang {data['sglang_version']}'s parser "
                "(the installed release's; checked against it by tests/launch)")
    try:
        return live_parser(), f"SGLang {sglang_version()}"
    except (ImportError, OSError) as e:   # SGLang or one of its dependencies missing
        return (parser_from_snapshot(data),
                f"snapshot of SGLang {data['sglang_version']}'s parser (SGLang not importable: "
                f"{e})")


def dumps(data: dict[str, Any]) -> str:
    """The snapshot file's text: one action per line (small, readable diffs)."""
    lines = [json.dumps(a, separators=(",", ":")) for a in data["actions"]]
    return ('{"sglang_version": ' + json.dumps(data["sglang_version"]) + ', "actions": [\n'
            + ",\n".join(lines) + "\n]}\n")


if __name__ == "__main__":
    sys.stdout.write(dumps(snapshot(live_parser(), sglang_version().split("+")[0])))
