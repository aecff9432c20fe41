"""The options of `bench workload` (`OPTIONS`, each value checked while parsing) and the L1/L2
overrides they set over the deployment file (`pools`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from offload.argtypes import count, names, positive, work_dir
from offload.bench.common import JSON, Args, Option
from offload.bench.workload.tiers import TIERS
from offload.errors import UsageError


def _ratio(text: str) -> float:
    value = positive(text)
    if value <= 1:
        raise ValueError("must be more than 1 (SGLang's host pool holds the device pool and more)")
    return value


def _users(text: str) -> str:
    values = [count(x.strip()) for x in text.split(",")]
    if values != sorted(set(values)):
        raise ValueError("user counts must be ascending, each once (e.g. 1,2,4,8)")
    return text


OPTIONS = (
    Option(("--config",), "deployment YAML every tier's server starts from (sglang-offload "
           "launch); its engine flags are used unchanged but for --l1-tokens / --l2-ratio "
           "(and SGLang's enable-metrics, on for every tier)",
           metavar="FILE", required=True),
    Option(("--tiers",), "L3 set-ups to compare, in this order (none: L1/L2 only; file: "
           "SGLang's stock file backend; ours: the offload tier); the first is the reference of "
           "the output agreement", "none,file,ours", names(*TIERS)),
    Option(("--groups",), "shared prefixes (SGLang's --gsp-num-groups)", 4, count),
    Option(("--users",), "conversations per shared prefix (--gsp-prompts-per-group)", 4, count),
    Option(("--turns",), "turns per conversation (--gsp-num-turns)", 3, count),
    Option(("--prefix-tokens",), "tokens of each shared prefix (--gsp-system-prompt-len)", 4096,
           count),
    Option(("--question-tokens",), "new tokens per turn (--gsp-question-len)", 128, count),
    Option(("--output-tokens",), "greedy tokens generated per turn (--gsp-output-len)", 8, count),
    Option(("--concurrency",), "users in flight (SGLang's --max-concurrency)", 4, count),
    Option(("--l1-tokens",), "SGLang's max-total-tokens (the L1 KV pool) over the file's",
           None, count),
    Option(("--l2-ratio",), "SGLang's hicache-ratio (the L2 host pool, times L1) over the "
           "file's", None, _ratio, metavar="X"),
    Option(("--repeat",), "rounds, the tiers alternating in each (medians reported)", 1, count),
    Option(("--cold-restart",), "at the restart, drop every L3 file from the page cache (written "
           "back first), so the restarted server reads its L3 from the disk, as after a reboot or "
           "on another host; without it a backend that reads through the page cache (SGLang's "
           "file L3) finds what it wrote minutes ago in RAM", False, flag=True),
    Option(("--unique",), "the cost where nothing repeats instead of the restart run: as many "
           "requests as the standard run, each a prompt of its own (--prefix-tokens + "
           "--question-tokens token ids, no page shared), one server per tier and round; each "
           "L3 against no L3 of the same round (throughput, mean / p90 TTFT, bytes written)",
           False, flag=True),
    Option(("--sweep-users",), "the concurrency question instead of the restart run: user "
           "counts to try, ascending (each user a context of --prefix-tokens, all in flight)",
           None, _users, metavar="LIST"),
    Option(("--ttft-target-ms",), "with --sweep-users: the p90 TTFT a user count must stay "
           "within (the sweep stops past it)", None, positive, metavar="MS"),
    Option(("--tie-margin",), "removed: a differing turn is judged at the logprob against the "
           "measured tolerance (offload.agree.tolerance_for, docs/design/agreement.md); giving "
           "it is an error", None, positive, metavar="X"),
    Option(("--seed",), "seed of SGLang's generated prompts; 0: a new one each run", 0, int),
    Option(("--dir",), "where the servers' L3 directories, deployment files and logs go "
           "(default: $TMPDIR; removed at the end unless --keep)", None, work_dir),
    Option(("--keep",), "keep the scratch directory (under --dir) at the end: each phase's "
           "client results (before.jsonl / after.jsonl: every request's cached tokens by tier), "
           "server logs and L3s, to compare runs request by request; its path is printed",
           False, flag=True),
    Option(("--start-timeout",), "seconds a server start may take", 600.0, positive),
    Option(("--client-timeout",), "seconds one run of SGLang's client may take", 3600.0,
           positive),
    JSON,
)


def pools(args: Args) -> dict[str, Any]:
    """The L1/L2 overrides, and what the file says otherwise (for the working-set note)."""
    try:
        doc = yaml.safe_load(Path(args.config).read_text()) or {}
    except (OSError, ValueError) as e:
        raise UsageError(f"--config {args.config}: cannot read it ({e})") from None
    sg = doc.get("sglang") if isinstance(doc, dict) else None
    if not isinstance(sg, dict):
        raise UsageError(f"--config {args.config}: expected a deployment file with a sglang: "
                         "section")
    # SGLang's Prometheus metrics on every tier alike: what each L3 held but SGLang did not load
    over: dict[str, Any] = {"enable-metrics": True}
    if args.l1_tokens:
        over["max-total-tokens"] = args.l1_tokens
    if args.l2_ratio:
        over["hicache-ratio"] = args.l2_ratio
    return over
