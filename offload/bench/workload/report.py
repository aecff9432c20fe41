"""The text table of `bench workload` (its --json is the result itself)."""

from __future__ import annotations

from typing import Any

from offload.bench.workload.tiers import STORAGE_NAMES


def _f(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _header(result: dict[str, Any]) -> str:
    w, srv = result["workload"], result.get("server") or {}
    return (f"bench workload: {srv.get('model_path')} on {srv.get('device')}, attention "
            f"{srv.get('attention_backend')}, page {srv.get('page_size')}, L1 "
            f"{srv.get('max_total_num_tokens')} tokens, L2 x{srv.get('hicache_ratio')}; "
            f"{w['groups']} prefixes of {w['prefix']} tokens x {w['users']} users x "
            f"{w['turns']} turns ({w['question']} new, {w['output']} generated), "
            f"{w['concurrency']} in flight, seed {w['seed']} (SGLang's {result['client']})"
            + ("; L3 files dropped from the page cache at the restart"
               if result.get("cold_restart") else ""))


def print_result(result: dict[str, Any]) -> None:
    if result["mode"] == "sweep":
        _print_sweep(result)
        return
    if result["mode"] == "unique":
        print_unique(result)
        return
    print(_header(result))
    print(f"{'tier':6} {'phase':7} {'reqs':>5} {'TTFT mean':>9} {'p50':>7} {'p90':>7} "
          f"{'req/s':>6} {'out tok/s':>9} {'cached':>8} {'device':>7} {'host':>7} "
          f"{'storage':>7} {'hit':>6}")
    for tier, phases in result.get("summary", {}).items():
        for phase, s in phases.items():
            t, c = s["ttft_ms"], s["cached_by_tier"]
            print(f"{tier:6} {phase:7} {s['requests']:>5} {_f(t['mean'], '.0f'):>9} "
                  f"{_f(t['p50'], '.0f'):>7} {_f(t['p90'], '.0f'):>7} "
                  f"{_f(s['throughput']['requests_per_s'], '.2f'):>6} "
                  f"{_f(s['throughput']['output_tokens_per_s'], '.1f'):>9} "
                  f"{s['cached_tokens']:>8} {c['device']:>7} {c['host']:>7} {c['storage']:>7} "
                  f"{s['hit_rate']:>6.1%}")
    for tier, phases in result.get("summary", {}).items():
        nl = phases.get("after", {}).get("l3_not_loaded_tokens")
        if tier != "none" and nl and nl.get("total"):
            print(f"{tier}: after the restart SGLang left {nl['total']:.0f} tokens of storage hits "
                  f"unloaded ({nl['host_capacity']:.0f} for want of L2 room), recomputed instead")
    for key, r in result.get("ratios", {}).items():
        a = r["after"]
        line = (f"{key} TTFT after the restart: mean {_f(a['mean'], '.2f')}x, p50 "
                f"{_f(a['p50'], '.2f')}x, p90 {_f(a['p90'], '.2f')}x")
        if "target" in r:
            line += (f" (target <= {r['target']['after_mean_at_most']}x: "
                     f"{'met' if r['target']['met'] else 'MISSED'})")
            if r["target"].get("why"):
                line += f"; why: {r['target']['why']}"
        print(line)
    ag = result.get("agreement") or {}
    if ag:
        n = ag["differing_conversations"]
        line = (f"outputs: {ag['requests']} replies compared with {ag['reference']}: "
                f"{'all agree' if not n else f'{n} conversations differ'}")
        if n:
            line += (f" ({ag['near_ties']} near-ties: the reference's margin within the "
                     f"tolerance of {_f(ag['tolerance'], 'g')} nats; {ag['real_differences']} real "
                     f"differences); re-asked with logprobs: largest |delta logprob| "
                     f"{_f(ag['max_delta'], '.4f')}, {ag['topk_mismatches']} top-k mismatches "
                     f"(over {ag['measured_over']})")
        print(line)
        for d in ag.get("differences", []):
            if d.get("verdict") == "different":
                print(f"  DIFFERENT: {d['tier']} round {d['round'] + 1} {d['phase']}, "
                      f"conversation {d['conversation']} turn {d['turn']}: margin "
                      f"{_f(d.get('margin'), '.4f')} at token {d.get('first_diff')} (None: the "
                      f"other's token not in the reference's top-5), probe reproduces "
                      f"{d.get('probe_reproduces')}")
    print("tiers: " + ", ".join(f"{t} = {STORAGE_NAMES[t]}" for t in result["tiers"]))


def _print_sweep(result: dict[str, Any]) -> None:
    s = result["sweep"]
    w = result["workload"]
    print(f"bench workload --sweep-users: users of {w['prefix']}-token contexts each, "
          f"{w['turns']} turns, all in flight; p90 TTFT target {s['ttft_target_ms']:.0f} ms")
    print(f"{'tier':6} {'users':>5} {'TTFT p50':>9} {'p90':>8} {'req/s':>6} {'storage':>8} "
          f"{'hit':>6} {'within':>6}")
    for tier, rounds in s["steps"].items():
        for rows in rounds:
            for r in rows:
                print(f"{tier:6} {r['users']:>5} {_f(r['ttft_ms']['p50'], '.0f'):>9} "
                      f"{_f(r['ttft_ms']['p90'], '.0f'):>8} "
                      f"{_f(r['throughput']['requests_per_s'], '.2f'):>6} "
                      f"{r['cached_by_tier']['storage']:>8} {r['hit_rate']:>6.1%} "
                      f"{'yes' if r['within'] else 'no':>6}")
    print("most users within the target: " + ", ".join(
        f"{t} {n}" for t, n in s["max_users"].items()))


def _mb(v: Any) -> str:
    return f"{v / 1e6:.1f}" if isinstance(v, (int, float)) else "-"


def print_unique(result: dict[str, Any]) -> None:
    """The unique run: per tier and round, the medians, and each L3 against no L3."""
    w, srv, fp = result["workload"], result.get("server") or {}, result.get("first_pages") or {}
    print(f"bench workload --unique: {srv.get('model_path')} on {srv.get('device')}, attention "
          f"{srv.get('attention_backend')}, page {srv.get('page_size')}, L1 "
          f"{srv.get('max_total_num_tokens')} tokens, L2 x{srv.get('hicache_ratio')}; "
          f"{w['requests']} prompts of {w['prefix'] + w['question']} tokens, each its own "
          f"({w['output']} generated), {w['concurrency']} in flight, seed {w['seed']} "
          f"(SGLang's {result['client']})")
    shared = fp.get("shared_pairs")
    print(f"no prefix repeats: {shared} pairs of {fp.get('prompts')} prompts share a first page "
          f"of {fp.get('page')} tokens" if shared is not None else
          f"first pages not checked: {fp.get('why')}")
    print(f"{'tier':6} {'round':>6} {'reqs':>5} {'TTFT mean':>9} {'p50':>7} {'p90':>7} "
          f"{'req/s':>6} {'tok/s':>8} {'cached':>7} {'L3 MB':>8} {'blocks':>7} {'drain s':>7}")
    rows = [(r["tier"], str(r["round"] + 1), r) for r in result.get("runs", [])]
    if len({r["round"] for r in result.get("runs", [])}) > 1:
        rows += [(t, "median", s) for t, s in result.get("summary", {}).items()]
    for tier, rnd, s in rows:
        t, th, l3 = s["ttft_ms"], s["throughput"], s["l3"]
        print(f"{tier:6} {rnd:>6} {_f(s['requests'], '.0f'):>5} {_f(t['mean'], '.0f'):>9} "
              f"{_f(t['p50'], '.0f'):>7} {_f(t['p90'], '.0f'):>7} "
              f"{_f(th['requests_per_s'], '.2f'):>6} {_f(th['tokens_per_s'], '.0f'):>8} "
              f"{_f(s['cached_tokens'], '.0f'):>7} {_mb(l3['bytes']):>8} {_f(l3['blocks'], '.0f'):>7} "
              f"{_f(l3['settle_s'], '.1f'):>7}")
    for key, r in result.get("ratios", {}).items():
        m, tg = r["median"], r["targets"]

        def verdict(k: str) -> str:
            bound, value = next((b, v) for b, v in tg[k].items() if b != "met")
            return (f"target {'>=' if bound == 'at_least' else '<='} {value}x: "
                    f"{'met' if tg[k]['met'] else 'MISSED'}")
        n = len(r["rounds"])
        print(f"{key} (median of {n} round{'s' if n != 1 else ''}, each against no L3 of its "
              f"round): req/s {_f(m['requests_per_s'], '.3f')}x ({verdict('requests_per_s')}), "
              f"tok/s {_f(m['tokens_per_s'], '.3f')}x ({verdict('tokens_per_s')}), TTFT mean "
              f"{_f(m['ttft_mean'], '.3f')}x ({verdict('ttft_mean')}), p90 "
              f"{_f(m['ttft_p90'], '.3f')}x")
    for tier, s in result.get("summary", {}).items():
        if tier != "none":
            print(f"{tier} wrote {_mb(s['l3']['bytes'])} MB to its L3 (median per round) for "
                  f"prompts no request reused")
    print("tiers: " + ", ".join(f"{t} = {STORAGE_NAMES[t]}" for t in result["tiers"]))
