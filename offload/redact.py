"""The one redaction path: what any output, log line or error may say about a secret.

Secrets of a deployment: the tenant salt (`offload.store.salt`), a Redis password inside
`offload.redis.url` (userinfo or a `?password=` option), the contents of the secret files
(`redis.password_file`, `redis.secret_file`, `agent.secret_file`, env SGLANG_OFFLOAD_SECRET)
and SGLang's own `api-key`, `admin-api-key` and `ssl-keyfile-password`. File *paths* are not
secrets and are shown.

Primitives:
- `MASK` (`***`): what is printed in place of a secret.
- `url(text)`: a URL with its password (and any query string or fragment) masked; the scheme, user, hosts
  and database stay, so a message still says which server.
- `value(key_path, value)`: the value of one config key fit to print (`repr`), masked if the key
  is secret-bearing. Every config error quoting a value goes through it.
- `tree(section, data)`: a copy of an `offload:` or `sglang:` tree fit to print.
- `argv(args, parser=None)`: a command line with the values of SGLang's secret flags masked
  (display only; SGLang itself gets the real ones), a flag being what SGLang's own parser
  resolves it to (argparse takes unique prefixes: `--api-k` is `--api-key`).
- `text(s, secrets)`: free text (an exception from a library, a YAML error) with URL passwords
  and each known secret string masked.
- `config_secrets(cfg)`: the secret strings of an `OffloadConfig` (for `text`).
"""

from __future__ import annotations

import copy
import re
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping
from urllib.parse import unquote

if TYPE_CHECKING:
    import argparse

    from offload.config import OffloadConfig

MASK = "***"
# Config keys whose whole value is a secret.
SECRET_KEYS = frozenset({"offload.store.salt"})
# Config keys holding a URL whose password is a secret.
URL_KEYS = frozenset({"offload.redis.url"})
# SGLang server arguments (dest names) that are secrets.
SGLANG_SECRET_KEYS = frozenset({"api_key", "admin_api_key", "ssl_keyfile_password"})
# scheme://userinfo@ inside free text (userinfo up to the last @ before a space or quote).
_URL_IN_TEXT = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)([^\s'\"<>]*@)")
_QUERY_IN_TEXT = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>?#]*)([?#])[^\s'\"<>]*")


def _userinfo(userinfo: str) -> str:
    """`user:password` -> `user:***`; a lone token is a user name (as `parse_url` reads it)."""
    user, colon, _ = userinfo.partition(":")
    return f"{user}:{MASK}" if colon else user


def url(text: str) -> str:
    """`text` with the password of a URL masked (and a query string, which may carry one)."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    if "@" in rest:
        userinfo, _, rest = rest.rpartition("@")
        rest = _userinfo(userinfo) + "@" + rest
    for mark in "?#":           # a query string or fragment may carry a password
        if mark in rest:
            rest = rest.partition(mark)[0] + mark + MASK
    return scheme + sep + rest


def value(key_path: str, val: Any) -> str:
    """`repr(val)` for a message about config key `key_path`, the secret part masked."""
    if key_path in SECRET_KEYS or key_path.rsplit(".", 1)[-1].replace("-", "_") in SGLANG_SECRET_KEYS:
        return repr(MASK)
    if key_path in URL_KEYS and isinstance(val, str):
        return repr(url(val))
    return repr(val)


def tree(section: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the `offload:` (section "offload") or `sglang:` tree fit to print."""
    out = copy.deepcopy(dict(data))
    if section == "sglang":
        for key in out:
            if str(key).replace("-", "_") in SGLANG_SECRET_KEYS and out[key] is not None:
                out[key] = MASK
        return out
    for path in SECRET_KEYS | URL_KEYS:
        parts = path.split(".")[1:]
        node: Any = out
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(parts[-1]):
            node[parts[-1]] = (url(node[parts[-1]]) if path in URL_KEYS
                               and isinstance(node[parts[-1]], str) else MASK)
    return out


def argv(args: list[str], parser: "argparse.ArgumentParser | None" = None) -> list[str]:
    """A command line fit to print: the values of SGLang's secret flags masked. A flag is what
    SGLang's parser (`parser`: launch hands `offload.launch.argspec.sglang_parser()`'s; without
    one, SGLang's own spellings of the secret flags and their prefixes) resolves it to:
    argparse takes a unique prefix of a long flag for it (`--api-k` is `--api-key`); a prefix it
    finds ambiguous is masked if any flag it may mean is a secret."""
    secret = _secret_flags(parser)
    out = list(args)
    for i, a in enumerate(args):
        if not a.startswith("--") or a == "--":
            continue
        name, eq, _ = a.partition("=")
        if secret(name):
            if eq:
                out[i] = f"{name}={MASK}"
            elif i + 1 < len(args):
                out[i + 1] = MASK
    return out


def _secret_flags(parser: "argparse.ArgumentParser | None") -> "Callable[[str], bool]":
    """Whether a long flag as typed names a secret, by the parser's own resolution."""
    dest: dict[str, str] = {"--" + k.replace("_", "-"): k for k in SGLANG_SECRET_KEYS}
    if parser is not None:
        dest = {o: a.dest for a in parser._actions for o in a.option_strings
                if o.startswith("--")}

    def secret(name: str) -> bool:
        if name in dest:
            return dest[name] in SGLANG_SECRET_KEYS
        # argparse's abbreviation: every long flag the typed one is a prefix of.
        return any(d in SGLANG_SECRET_KEYS for o, d in dest.items() if o.startswith(name))

    return secret


def text(s: str, secrets: Iterable[str] = ()) -> str:
    """Free text with URL userinfo and query strings masked, then every known secret string."""
    s = _URL_IN_TEXT.sub(lambda m: m.group(1) + _userinfo(m.group(2)[:-1]) + "@", s)
    s = _QUERY_IN_TEXT.sub(lambda m: m.group(1) + m.group(2) + MASK, s)
    for secret in sorted({x for x in secrets if x and len(x) >= 4}, key=len, reverse=True):
        s = s.replace(secret, MASK)
    return s


def url_password(u: str | None) -> str | None:
    """The password a Redis URL carries (decoded), if any."""
    if not u:
        return None
    rest = u.partition("://")[2] or u
    if "@" not in rest:
        return None
    _, colon, pw = rest.rpartition("@")[0].partition(":")
    return unquote(pw) if colon else None


def config_secrets(cfg: "OffloadConfig") -> list[str]:
    """The secret strings held by a config's values (not the contents of its secret files)."""
    out = [cfg.store.salt]
    pw = url_password(cfg.redis.url)
    if pw:
        out += [pw, cfg.redis.url.partition("://")[2].rpartition("@")[0] if cfg.redis.url else ""]
    return [s for s in out if s]
