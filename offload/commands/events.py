"""`sglang-offload events URL [URL ...] (--prompt TEXT | --input-ids FILE)`: how much of a prompt's
prefix each server holds in each tier, from its KV-event stream (what a KV-aware router scores).

For each server (its HTTP URL): `/server_info` gives its `kv_events_config` (the ZMQ publisher,
its replay endpoint and topic; a wildcard host is reached at the URL's host) and its page size;
the prompt's token ids come from `--input-ids` (a JSON list) or the server's own `/tokenize`
(`--prompt`, with the tokenizer's special tokens, as `/generate` adds them). The command asks the
replay endpoint for every batch the publisher still holds, listens `--listen` seconds for live
ones, and prints per server the leading pages (and tokens) of the prompt held on `GPU`,
`CPU_PINNED`, `DISK` and `EXTERNAL` (`offload.events.subscribe`). The prompt's block hashes are
SGLang's own chain (`get_hash_str`) for a request without LoRA adapter or cache salt.

Exit 0; 2 for bad options; 1 when a server cannot be asked (no KV events configured, unreachable,
no answer from its replay endpoint).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from offload.argtypes import arg, positive
from offload.errors import RunError, UsageError

TIERS = ("GPU", "CPU_PINNED", "DISK", "EXTERNAL")


def _http_url(text: str) -> str:
    u = urllib.parse.urlparse(text)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError("not an http(s)://HOST:PORT server URL")
    return text.rstrip("/")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("servers", nargs="+", metavar="URL", type=arg(_http_url),
                   help="a server's HTTP URL, e.g. http://127.0.0.1:30000 (one or more)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt", metavar="TEXT", help="the prompt (tokenized by each server)")
    which.add_argument("--input-ids", metavar="FILE", type=arg(_ids_file),
                       help="a JSON file with the prompt's token ids (a list of integers)")
    p.add_argument("--listen", metavar="SECONDS", type=arg(positive), default=2.0,
                   help="how long to read live events after the replay (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _ids_file(text: str) -> list[int]:
    try:
        ids = json.loads(Path(text).read_text())
    except OSError as e:
        raise ValueError(f"cannot read it: {e.strerror}") from None
    except ValueError:
        raise ValueError("not JSON") from None
    if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids) or not ids:
        raise ValueError("must hold a non-empty JSON list of token ids (integers >= 0)")
    return ids


def _get(url: str, body: dict | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise RunError(f"{url}: {getattr(e, 'reason', e)}") from None


def _find(info: Any, key: str) -> Any:
    """`key` in /server_info, at the top or in a nested group of server arguments."""
    if isinstance(info, dict):
        if info.get(key) is not None:
            return info[key]
        for v in info.values():
            found = _find(v, key)
            if found is not None:
                return found
    return None


def endpoints(url: str, info: dict) -> tuple[str, str | None, str, int]:
    """(publisher, replay endpoint or None, topic, page size) of a server's /server_info."""
    raw = _find(info, "kv_events_config")
    if not raw:
        raise RunError(f"{url}: the server publishes no KV events; fix: start it with "
                       "kv-events-config (docs/reference/events.md)")
    try:
        cfg = json.loads(raw) if isinstance(raw, str) else dict(raw)
    except ValueError:
        raise RunError(f"{url}: its kv_events_config is not JSON: {raw!r}") from None
    if cfg.get("publisher") != "zmq":
        raise RunError(f"{url}: KV events publisher {cfg.get('publisher')!r}, not zmq")
    host = urllib.parse.urlparse(url).hostname or "127.0.0.1"

    def reach(ep: str | None) -> str | None:
        if not ep:
            return None
        for wild in ("*", "0.0.0.0"):
            ep = ep.replace(f"//{wild}:", f"//{host}:")
        return ep

    return (str(reach(cfg.get("endpoint", "tcp://*:5557"))), reach(cfg.get("replay_endpoint")),
            str(cfg.get("topic", "")), int(_find(info, "page_size") or 1))


def survey(url: str, prompt: str | None, ids: list[int] | None, listen_s: float) -> dict:
    from offload.events.subscribe import Residency, Subscriber, prompt_hashes

    info = _get(url + "/server_info")
    pub, replay, topic, page = endpoints(url, info)
    if ids is None:
        got = _get(url + "/tokenize", {"prompt": prompt, "add_special_tokens": True})
        ids = list(got.get("tokens") or [])
    hashes = prompt_hashes(ids, page)
    sub = Subscriber(pub, replay, topic)
    res = Residency()
    try:
        try:
            batches = sub.replay(0)
        except TimeoutError as e:
            raise RunError(f"{url}: {e}") from None
        batches += sub.poll(listen_s)
    finally:
        sub.close()
    for seq, batch in sorted(batches, key=lambda b: b[0]):
        res.apply(seq, batch)
    tiers = {t: res.prefix_pages(hashes, t) for t in TIERS}
    return {"server": url, "prompt_tokens": len(ids), "page_size": page, "pages": len(hashes),
            "batches": len(batches), "replay": replay is not None,
            "tiers": {t: {"pages": n, "tokens": n * page} for t, n in tiers.items()}}


def run(args: argparse.Namespace) -> int:
    if args.prompt is not None and not args.prompt:
        raise UsageError("--prompt: empty; give the prompt's text")
    out = [survey(u, args.prompt, args.input_ids, args.listen) for u in args.servers]
    if args.json:
        print(json.dumps({"servers": out}, indent=1))
        return 0
    print(f"{'server':<28} {'pages':>5}  " + "  ".join(f"{t:>10}" for t in TIERS))
    for s in out:
        cells = "  ".join(f"{s['tiers'][t]['tokens']:>10}" for t in TIERS)
        print(f"{s['server']:<28} {s['pages']:>5}  {cells}")
        if not s["replay"]:
            print(f"  ({s['server']}: no replay endpoint: only events of the last "
                  f"{args.listen:g} s are counted)", file=sys.stderr)
    print("(tokens of the prompt's leading full pages held in each tier)")
    return 0
