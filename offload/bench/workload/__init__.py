"""`sglang-offload bench workload`: many users, long shared prefixes, multi-turn, on SGLang's client.

The package, one role per module: `options` (the flags and their checks), `main` (`run`: one of
the three runs below, the exit code), `server` (a tier's server started and warmed), `restart`
(the restart run, its ratios and output agreement), `sweep`, `unique`, `tiers` (the three L3
set-ups), `client` (SGLang's client), `margin` (a differing turn judged at the logprob), `report` (the
text table), `plot` (the figure).

The workload is SGLang's own: `python -m sglang.benchmark.serving --dataset-name
generated-shared-prefix --gsp-num-turns T --cache-report` (`client`):
`--groups` shared prefixes of `--prefix-tokens`, `--users` conversations on each, `--turns`
turns of `--question-tokens` new tokens and `--output-tokens` greedy tokens, `--concurrency`
users in flight. It runs against one server per tier (`--tiers`, `tiers`):
no L3, SGLang's stock `file` L3, ours; the same deployment file, so the same engine flags, with
L1 (`--l1-tokens`, SGLang's max-total-tokens) and L2 (`--l2-ratio`, its hicache-ratio) set over
the file's (keep them below the working set so that L3, or a recompute, serves what they drop).

Restart run (the default): each tier's server serves the workload, waits for its write-back,
restarts on the same L3 (L1/L2 empty), and serves the same workload again (the same users coming
back: every conversation re-sent, turn by turn). Per tier and phase (before / after the
restart): TTFT mean / p50 / p90, throughput, cached tokens by tier (device / host / storage from
SGLang's cached_tokens_details), and the storage hits SGLang did not load (by its own metrics,
on for every tier: `host_capacity` is a hit trimmed to the L2 host pool's room, the rest
recomputed; it falls on whichever users' prefetches overlap, so it moves the mean TTFT of any L3
from run to run); ratios of ours to no L3 and to `file` (targets: <= 0.5x and <=
0.8x, after the restart; a missed one says why where the cause is known: the worth-it rule,
a load cannot beat a cheap prefill); greedy-output agreement with the reference (the first
tier's first phase), where a differing turn is asked again with logprobs on a server without L3
and judged at the logprob (`margin`): a near-tie where the reference ranked the other's token
within the model's measured tolerance (`offload.agree.tolerance_for`) of its own, else a real
difference (exit 1); the re-asks'
largest |delta logprob| and top-k mismatches are reported. Every server computes the lm head
in float32 (`enable-fp32-lm-head`). `--tie-margin` (the old top-2 rule) is an error now.
`--repeat` rounds alternate the tiers (A B C A B C); medians are reported, every round in --json.

Unique (`--unique`, `unique`): no prefix ever repeats; as many requests
as the standard run, each a prompt of its own; per tier and round one server, no restart; each
L3 against no L3 of the same round: requests/s, tokens/s, mean and p90 TTFT (targets >= 0.97x
the throughput, <= 1.05x the mean TTFT), and the bytes the L3 wrote. Exit 1 on a failed request
or where two prompts shared a first page.

Sweep (`--sweep-users LIST --ttft-target-ms MS`): how many users with long contexts the box
serves within a TTFT target, per tier. For each user count U (ascending) on one server per tier:
U users, each with a context of its own (`--prefix-tokens`), all in flight, send their
conversation; then they come back and send it again (measured); the sweep stops at the first U
whose p90 TTFT exceeds the target. Reported: each step, and the most users within the target.
"""

from offload.bench.workload.main import run
from offload.bench.workload.options import OPTIONS

__all__ = ["OPTIONS", "run"]
