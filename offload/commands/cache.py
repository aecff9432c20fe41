"""`sglang-offload cache ACTION DIR [DIR ...]`: inspect and maintain cache directories.

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

Several directories (the drives of one `offload.store.paths` store) are handled drive by drive,
with a total: `stats` and `verify` print each drive and all together; `evict --to SIZE` brings each
drive down to its share of SIZE (in proportion to the capacity its index records); `clear
--namespace` clears it on every drive that holds it. A drive that cannot be opened is reported on
its own line (exit 1) and the others are still done.

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

from offload.argtypes import arg
from offload.config import Size, format_size
from offload.errors import RunError, StoreError, UsageError
from offload.store.factory import open_existing

log = logging.getLogger("offload.cache")


def _keep_size(text: str) -> int:
    return int(Size.parse(text))


DIRS_HELP = "cache directory (offload.store.path); several: the drives of offload.store.paths"


def _fresh(directory: str) -> bool:
    """A directory made for a cache and never used yet (`mkdir -m 700 DIR`, as deploy/drives.md
    makes one): it exists and is empty (but for a lock or lease file a store left). Any other
    file -- a slab without an index, or a directory that is no cache (a typo) -- is not fresh.
    Looked at only, never written."""
    try:
        names = os.listdir(directory)
    except OSError:
        return False
    return all(n == "lock" or n.startswith("lease-") for n in names)


def _each(dirs: list[str], fn: Any,
          fresh: Any = None) -> tuple[list[Any], list[dict[str, str]]]:
    """`fn(store, directory)` for every directory; with several, a directory that cannot be
    opened is collected ({dir, error}) and the others are done (with one, its error is raised).
    `fresh(directory)`: the result for a directory that holds no cache yet (`_fresh`: nothing is
    opened or created in it); without it, such a directory is an error."""
    done: list[Any] = []
    failed: list[dict[str, str]] = []
    for d in dirs:
        if fresh is not None and _fresh(d):
            log.debug("%s holds no cache yet (no index, no slab file): nothing opened", d)
            done.append(fresh(d))
            continue
        try:
            store = open_existing(d)
        except (UsageError, StoreError) as e:
            if len(dirs) == 1:
                raise
            failed.append({"dir": os.path.abspath(d), "error": str(e)})
            continue
        try:
            done.append(fn(store, d))
        finally:
            store.close()
    return done, failed


def _print_failed(failed: list[dict[str, str]]) -> None:
    for f in failed:
        why = f["error"]
        for name in (f["dir"], os.path.relpath(f["dir"])):
            why = why.removeprefix(f"{name}: ")
        print(f"drive {f['dir']}: not done: {why}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    s = sub.add_parser("stats", help="blocks, bytes, namespaces, age, hit rates")
    s.add_argument("dirs", nargs="+", metavar="DIR", help=DIRS_HELP)
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--metrics-url", metavar="URL",
                   help="a server's /metrics (SGLang's with --enable-metrics, or "
                        "offload.metrics.port) for the hit rates")
    v = sub.add_parser("verify", help="re-read every block, check its checksum, delete bad ones")
    v.add_argument("dirs", nargs="+", metavar="DIR", help=DIRS_HELP)
    v.add_argument("--json", action="store_true", help="print one JSON object")
    e = sub.add_parser("evict", help="evict least-recently-used blocks down to a size")
    e.add_argument("dirs", nargs="+", metavar="DIR", help=DIRS_HELP)
    e.add_argument("--to", required=True, metavar="SIZE", type=arg(_keep_size),
                   help="bytes to keep, e.g. 500GiB")
    c = sub.add_parser("clear", help="delete the blocks of one namespace, or all")
    c.add_argument("dirs", nargs="+", metavar="DIR", help=DIRS_HELP)
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


def _summary(store: Any, directory: str) -> dict[str, Any]:
    summary = store.summary()
    st = store.stats()
    nss = summary["namespaces"]
    log.debug("index of %s: %d blocks, %d bytes used, %d being written, %d namespace(s)", directory,
              st.blocks, summary["used_bytes"], summary["pending"], len(nss))
    for n in nss:
        log.debug("namespace %s: %d blocks, %d data bytes, %s", n["digest"], n["blocks"],
                  n["data_bytes"], "described" if n["description"] else "not described")
    return {
        "dir": os.path.abspath(directory), "blocks": st.blocks,
        "data_bytes": sum(n["data_bytes"] for n in nss), "used_bytes": summary["used_bytes"],
        "reserved_bytes": summary.get("reserved_bytes", 0),
        "capacity": summary["capacity"], "pending": summary["pending"],
        "oldest": min((n["oldest"] for n in nss if n["oldest"]), default=None),
        "newest": max((n["newest"] for n in nss if n["newest"]), default=None),
        "last_use": max((n["last_use"] for n in nss if n["last_use"]), default=None),
        "namespaces": nss,
    }


def _empty_summary(directory: str) -> dict[str, Any]:
    """`cache stats` of a directory that holds no cache yet: nothing stored."""
    return {"dir": os.path.abspath(directory), "fresh": True, "blocks": 0, "data_bytes": 0,
            "used_bytes": 0, "reserved_bytes": 0, "capacity": 0, "pending": 0, "oldest": None,
            "newest": None, "last_use": None, "namespaces": []}


def _total(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Every drive's summary as one (namespaces merged by digest)."""
    nss: dict[str, dict[str, Any]] = {}
    for r in rows:
        for n in r["namespaces"]:
            m = nss.setdefault(n["digest"], dict(n, blocks=0, data_bytes=0))
            m["blocks"] += n["blocks"]
            m["data_bytes"] += n["data_bytes"]
            for k, pick in (("oldest", min), ("newest", max), ("last_use", max)):
                vals = [v for v in (m.get(k), n.get(k)) if v]
                m[k] = pick(vals) if vals else None
            m["description"] = m.get("description") or n.get("description")
    out: dict[str, Any] = {"dir": [r["dir"] for r in rows]}
    for k in ("blocks", "data_bytes", "used_bytes", "reserved_bytes", "capacity", "pending"):
        out[k] = sum(r[k] for r in rows)
    for k, pick in (("oldest", min), ("newest", max), ("last_use", max)):
        vals = [r[k] for r in rows if r[k]]
        out[k] = pick(vals) if vals else None
    out["namespaces"] = list(nss.values())
    return out


def _print_summary(out: dict[str, Any], title: str, namespaces: bool = True) -> None:
    cap = out["capacity"]
    nss = out["namespaces"]
    pct = f", {out['used_bytes'] / cap:.0%} of the cap" if cap else ""
    print(title)
    if out.get("fresh"):
        print("  empty      no cache written here yet")
        return
    print(f"  blocks     {out['blocks']:,} ({format_size(out['data_bytes'])} of data, "
          f"{format_size(out['used_bytes'])} used of {format_size(cap)}{pct})"
          + (f", {out['pending']} being written" if out["pending"] else "")
          + (f"; {format_size(out['reserved_bytes'])} of slots held ahead by open processes"
             if out["reserved_bytes"] else ""))
    if not namespaces:
        return
    print(f"  written    oldest {_when(out['oldest'])}, newest {_when(out['newest'])}")
    print(f"  last use   {_when(out['last_use'])}")
    print(f"  namespaces {len(nss)}")
    for n in nss:
        print(f"    {n['digest']}  {n['blocks']:,} blocks  {format_size(n['data_bytes'])}  "
              f"{describe(n['description'])}")


def _stats(args: argparse.Namespace) -> int:
    rows, failed = _each(args.dirs, _summary, fresh=_empty_summary)
    rates = hit_rates(args.metrics_url) if args.metrics_url else None
    several = len(args.dirs) > 1
    out = dict(_total(rows), drives=rows, failed=failed) if several else rows[0]
    out["hit_rates"] = rates
    if args.json:
        print(json.dumps(out, indent=2))
        return 1 if failed else 0
    if several:
        for r in rows:
            _print_summary(r, f"drive {r['dir']}", namespaces=False)
        _print_failed(failed)
        _print_summary(out, f"cache over {len(rows)} of {len(args.dirs)} drives")
    else:
        _print_summary(out, f"cache {out['dir']}")
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
    return 1 if failed else 0


def _verify(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    def one(store: Any, directory: str) -> dict[str, Any]:
        total = store.stats().blocks
        log.debug("verifying %d blocks of %s", total, directory)
        with tqdm(total=total, desc=f"verify {directory}" if len(args.dirs) > 1 else "verify",
                  unit="block", file=sys.stderr) as bar:
            checked, bad = store.verify(bar.update)
        rows = [{"key": k.hex(), "namespace": k[:16].hex(), "reason": got.reason,
                 "deleted": got.corrupt} for k, got in bad]
        return {"dir": os.path.abspath(directory), "checked": checked, "bad": rows}

    done, failed = _each(args.dirs, one, fresh=lambda d: {"dir": os.path.abspath(d), "checked": 0,
                                                          "bad": []})
    bad = [r for d in done for r in d["bad"]]
    checked = sum(d["checked"] for d in done)
    if args.json:
        out: dict[str, Any] = done[0] if len(args.dirs) == 1 else {
            "dir": [d["dir"] for d in done], "checked": checked, "bad": bad, "drives": done,
            "failed": failed}
        print(json.dumps(out, indent=2))
    else:
        for d in done:
            for r in d["bad"]:
                print(f"bad block {r['key']}: {r['reason']} "
                      f"({'deleted' if r['deleted'] else 'kept: read error, not proven corrupt'})")
            if len(args.dirs) > 1:
                print(f"drive {d['dir']}: checked {d['checked']:,} blocks: {len(d['bad'])} bad")
        _print_failed(failed)
        print(f"checked {checked:,} blocks: {len(bad)} bad"
              + (f", {sum(r['deleted'] for r in bad)} deleted" if bad else "")
              + (f" ({len(done)} of {len(args.dirs)} drives)" if len(args.dirs) > 1 else ""))
    return 1 if bad or failed else 0


def _evict(args: argparse.Namespace) -> int:
    target = args.to
    caps, _ = _each(args.dirs, lambda store, _d: store.stats().capacity)
    whole = sum(caps) or 1

    def one(store: Any, directory: str) -> tuple[int, int, int, int]:
        share = target if len(args.dirs) == 1 else int(target * store.stats().capacity / whole)
        before = store.stats().bytes_used
        log.debug("%s: %d bytes used, evicting down to %d", directory, before, share)
        n = store.evict_to(share)
        return n, before, store.stats().bytes_used, share

    done, failed = _each(args.dirs, one)
    for d, (n, before, after, share) in zip(args.dirs, done) if len(args.dirs) > 1 else ():
        print(f"drive {os.path.abspath(d)}: evicted {n:,} blocks: {format_size(before)} -> "
              f"{format_size(after)} used (its share {format_size(share)})")
    _print_failed(failed)
    n, before, after = (sum(x[i] for x in done) for i in range(3))
    print(f"evicted {n:,} blocks: {format_size(before)} -> {format_size(after)} used "
          f"(target {format_size(target)})")
    return 1 if failed else 0


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
    where = " ".join(args.dirs)
    held_by, failed = _each(args.dirs, lambda store, _d: (
        {n["digest"]: n["blocks"] for n in store.summary()["namespaces"]}, store.stats().blocks))
    held: dict[str, int] = {}
    for h, _ in held_by:
        for k, v in h.items():
            held[k] = held.get(k, 0) + v
    if digest is not None and digest.hex() not in held:
        raise UsageError(f"--namespace {args.namespace}: no such namespace in {where}; it "
                         "holds " + (", ".join(held) if held else "none") + " (cache stats)")
    if digest is None and not args.yes and not _confirm(where, sum(b for _, b in held_by)):
        raise UsageError("cache clear --all: not confirmed; nothing deleted (pass --yes to "
                         "clear without the question)")
    log.debug("clearing %s of %s (%d blocks)", digest.hex() if digest else "every namespace",
              where, held[digest.hex()] if digest else sum(held.values()))
    done, more = _each(args.dirs, lambda store, _d: store.clear(digest))
    _print_failed(failed or more)
    print(f"deleted {sum(done):,} blocks" + (f" of namespace {args.namespace}" if digest else "")
          + (f" on {len(done)} of {len(args.dirs)} drives" if len(args.dirs) > 1 else ""))
    return 1 if failed or more else 0


def _confirm(directory: str, blocks: int) -> bool:
    """Ask on a terminal before deleting every block; without one, only --yes confirms."""
    if not sys.stdin.isatty():
        return False
    print(f"delete all {blocks:,} blocks of {directory}? [y/N] ", end="", file=sys.stderr,
          flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def run(args: argparse.Namespace) -> int:
    return {"stats": _stats, "verify": _verify, "evict": _evict, "clear": _clear}[args.action](args)
