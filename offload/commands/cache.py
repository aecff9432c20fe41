"""`sglang-offload cache ACTION DIR`: inspect and maintain a cache directory.

Actions: `stats` (blocks, bytes, namespaces with their descriptions: KV pages or the SGLang v2 pool
they hold, e.g. `pool mamba`; oldest/newest, hit rates from
a metrics endpoint), `verify` (re-read every block and check its checksum; bad ones are deleted;
exit 1 if any), `evict --to SIZE` (least recently used first), `clear --namespace DIGEST | --all`
(a digest the directory does not hold is an error listing those it holds; `--all` asks first on a
terminal, and needs `--yes` otherwise).
Every action goes through `DiskStore`, which several processes may open at once, so they are safe
while a server uses the directory: `used` counts stored blocks (the slots processes hold ahead are
shown apart), and an index found damaged while another process has the directory open is not
rebuilt (a clear error; the first open alone rebuilds it). The directory's capacity cap is read
from its index and kept.

Hit rates are not stored in the directory (counting every hit there would put a write on the
read path); they come from the `sglang_offload_hits_total` / `_misses_total` counters of a running
server's metrics endpoint (`--metrics-url`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import urllib.request
from typing import Any

from offload.commands.argtypes import arg
from offload.config import Size, format_size
from offload.errors import RunError, UsageError
from offload.store.factory import open_existing

log = logging.getLogger("offload.cache")


def _keep_size(text: str) -> int:
    return int(Size.parse(text))


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    s = sub.add_parser("stats", help="blocks, bytes, namespaces, age, hit rates")
    s.add_argument("dir")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--metrics-url", metavar="URL",
                   help="a server's /metrics (SGLang's with --enable-metrics, or "
                        "offload.metrics.port) for the hit rates")
    v = sub.add_parser("verify", help="re-read every block, check its checksum, delete bad ones")
    v.add_argument("dir")
    v.add_argument("--json", action="store_true", help="print one JSON object")
    e = sub.add_parser("evict", help="evict least-recently-used blocks down to a size")
    e.add_argument("dir")
    e.add_argument("--to", required=True, metavar="SIZE", type=arg(_keep_size),
                   help="bytes to keep, e.g. 500GiB")
    c = sub.add_parser("clear", help="delete the blocks of one namespace, or all")
    c.add_argument("dir")
    which = c.add_mutually_exclusive_group(required=True)
    which.add_argument("--namespace", metavar="DIGEST", help="namespace digest (hex, see stats)")
    which.add_argument("--all", action="store_true",
                       help="every block of the directory (asks first; --yes skips the question)")
    c.add_argument("--yes", action="store_true", help="do not ask before --all")


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if t else "-"


def hit_rates(url: str) -> dict[str, dict[str, float]]:
    """Per-tier hits, misses and hit rate from a Prometheus text endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--metrics-url {url!r}: give http://HOST:PORT/metrics of a running server")
    log.debug("reading hit counters from %s", url)
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read(64 << 20).decode("utf-8", "replace")
            log.debug("%s: HTTP %s, %d bytes", url, r.status, len(text))
    except (OSError, ValueError) as e:
        raise RunError(f"--metrics-url {url}: {e}") from None
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as e:
        raise RunError(f"--metrics-url {url}: not Prometheus text ({str(e)[:80]}); give the "
                       "/metrics page of SGLang (--enable-metrics) or of offload.metrics.port") from None
    counts: dict[str, dict[str, float]] = {}
    for fam in families:
        if fam.name not in ("sglang_offload_hits", "sglang_offload_misses"):
            continue
        kind = fam.name.rsplit("_", 1)[1]
        for s in fam.samples:
            if s.name.endswith("_total"):
                tier = counts.setdefault(s.labels.get("tier", "?"), {"hits": 0.0, "misses": 0.0})
                tier[kind] += s.value
    for c in counts.values():
        total = c["hits"] + c["misses"]
        c["hit_rate"] = c["hits"] / total if total else 0.0
    log.debug("%d metric families; offload hit counters for tier(s): %s", len(families),
              ", ".join(sorted(counts)) or "none")
    return counts


def describe(d: dict[str, Any] | None) -> str:
    """One line for a namespace description (`Namespace.describe()`)."""
    if not d:
        return "(not described: written by a process that did not register it)"
    pool = str(d.get("pool") or "")
    if pool:   # a sidecar pool of SGLang's v2 interface (offload.hicache.pools)
        from offload.hicache.pools import family_of

        head = f"pool {pool} ({family_of(pool)})"
    else:
        head = "KV pages"
    parts = [head, f"{d.get('model')!s}", f"{d.get('dtype')}", f"layout {d.get('layout')}",
             f"page {d.get('page_size')}", f"tp {d.get('tp_rank')}/{d.get('tp_size')}",
             f"pp {d.get('pp_rank')}/{d.get('pp_size')}"]
    if d.get("mla"):
        parts.append("MLA")
    if d.get("salt"):
        parts.append("salted")
    if d.get("extra"):
        parts.append(str(d["extra"]))
    return ", ".join(parts)


def _stats(args: argparse.Namespace) -> int:
    store = open_existing(args.dir)
    try:
        summary = store.summary()
        st = store.stats()
    finally:
        store.close()
    nss = summary["namespaces"]
    log.debug("index: %d blocks, %d bytes used, %d being written, %d namespace(s)", st.blocks,
              summary["used_bytes"], summary["pending"], len(nss))
    for n in nss:
        log.debug("namespace %s: %d blocks, %d data bytes, %s", n["digest"], n["blocks"],
                  n["data_bytes"], "described" if n["description"] else "not described")
    out: dict[str, Any] = {
        "dir": os.path.abspath(args.dir), "blocks": st.blocks,
        "data_bytes": sum(n["data_bytes"] for n in nss), "used_bytes": summary["used_bytes"],
        "reserved_bytes": summary.get("reserved_bytes", 0),
        "capacity": summary["capacity"], "pending": summary["pending"],
        "oldest": min((n["oldest"] for n in nss if n["oldest"]), default=None),
        "newest": max((n["newest"] for n in nss if n["newest"]), default=None),
        "last_use": max((n["last_use"] for n in nss if n["last_use"]), default=None),
        "namespaces": nss,
        "hit_rates": hit_rates(args.metrics_url) if args.metrics_url else None,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    cap = out["capacity"]
    pct = f", {out['used_bytes'] / cap:.0%} of the cap" if cap else ""
    print(f"cache {out['dir']}")
    print(f"  blocks     {out['blocks']:,} ({format_size(out['data_bytes'])} of data, "
          f"{format_size(out['used_bytes'])} used of {format_size(cap)}{pct})"
          + (f", {out['pending']} being written" if out["pending"] else "")
          + (f"; {format_size(out['reserved_bytes'])} of slots held ahead by open processes"
             if out["reserved_bytes"] else ""))
    print(f"  written    oldest {_when(out['oldest'])}, newest {_when(out['newest'])}")
    print(f"  last use   {_when(out['last_use'])}")
    print(f"  namespaces {len(nss)}")
    for n in nss:
        print(f"    {n['digest']}  {n['blocks']:,} blocks  {format_size(n['data_bytes'])}  "
              f"{describe(n['description'])}")
    rates = out["hit_rates"]
    if rates is None:
        print("  hit rate   not recorded in the directory; pass --metrics-url "
              "http://HOST:PORT/metrics of a running server")
    else:
        used = {t: c for t, c in sorted(rates.items()) if c["hits"] + c["misses"]}
        if not used:
            print("  hit rate   no loads recorded by the server yet")
        for tier, c in used.items():
            print(f"  hit rate   {tier}: {c['hit_rate']:.1%} ({c['hits']:.0f} hits, "
                  f"{c['misses']:.0f} misses since the server started)")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    store = open_existing(args.dir)
    try:
        total = store.stats().blocks
        log.debug("verifying %d blocks of %s", total, args.dir)
        with tqdm(total=total, desc="verify", unit="block", file=sys.stderr) as bar:
            checked, bad = store.verify(bar.update)
    finally:
        store.close()
    rows: list[dict[str, Any]] = [{"key": k.hex(), "namespace": k[:16].hex(), "reason": got.reason,
             "deleted": got.corrupt} for k, got in bad]
    if args.json:
        print(json.dumps({"dir": os.path.abspath(args.dir), "checked": checked, "bad": rows},
                         indent=2))
    else:
        for r in rows:
            print(f"bad block {r['key']}: {r['reason']} "
                  f"({'deleted' if r['deleted'] else 'kept: read error, not proven corrupt'})")
        print(f"checked {checked:,} blocks: {len(rows)} bad"
              + (f", {sum(r['deleted'] for r in rows)} deleted" if rows else ""))
    return 1 if rows else 0


def _evict(args: argparse.Namespace) -> int:
    target = args.to
    store = open_existing(args.dir)
    try:
        before = store.stats().bytes_used
        log.debug("%s: %d bytes used, evicting down to %d", args.dir, before, target)
        n = store.evict_to(target)
        after = store.stats().bytes_used
    finally:
        store.close()
    print(f"evicted {n:,} blocks: {format_size(before)} -> {format_size(after)} used "
          f"(target {format_size(target)})")
    return 0


def _clear(args: argparse.Namespace) -> int:
    digest: bytes | None = None
    if not args.all:
        try:
            digest = bytes.fromhex(args.namespace)
        except ValueError:
            digest = b""
        if len(digest) != 16:
            raise UsageError(f"--namespace {args.namespace!r}: expected a 32-digit hex digest "
                             "as shown by `cache stats`")
    store = open_existing(args.dir)
    try:
        held = {n["digest"]: n["blocks"] for n in store.summary()["namespaces"]}
        if digest is not None and digest.hex() not in held:
            raise UsageError(f"--namespace {args.namespace}: no such namespace in {args.dir}; it "
                             "holds " + (", ".join(held) if held else "none") + " (cache stats)")
        if digest is None and not args.yes and not _confirm(args.dir, store.stats().blocks):
            raise UsageError("cache clear --all: not confirmed; nothing deleted (pass --yes to "
                             "clear without the question)")
        log.debug("clearing %s of %s (%d blocks)", digest.hex() if digest else "every namespace",
                  args.dir, held[digest.hex()] if digest else sum(held.values()))
        n = store.clear(digest)
    finally:
        store.close()
    print(f"deleted {n:,} blocks" + (f" of namespace {args.namespace}" if digest else ""))
    return 0


def _confirm(directory: str, blocks: int) -> bool:
    """Ask on a terminal before deleting every block; without one, only --yes confirms."""
    if not sys.stdin.isatty():
        return False
    print(f"delete all {blocks:,} blocks of {directory}? [y/N] ", end="", file=sys.stderr,
          flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def run(args: argparse.Namespace) -> int:
    return {"stats": _stats, "verify": _verify, "evict": _evict, "clear": _clear}[args.action](args)
