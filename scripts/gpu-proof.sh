#!/usr/bin/env bash
# The GPU proof, as one prepared script for a lent GPU machine (no network, one H200, <= 8 minutes):
#   1. installs the wheels of .whl/ (scripts/gpu-wheels.sh) with `pip --no-index --no-deps
#      --target DIR`: nothing is downloaded; the machine's own torch, cupy and nvidia-cufile are used;
#   2. runs every test marked `gpu` (the files that carry the marker);
#   3. measures the headline (scripts/gpu_proof.py): prefill of 32K / 64K / 128K-token prompts on a
#      Llama-3.1-8B-shaped model against loading the same KV bytes from the block store through cpu
#      staging and gds; writes gpu-proof.json + gpu-proof.png to $OUT (default ./gpu-proof-out).
#
#   4. with --config FILE (a GPU host's deployment file, e.g. configs/llama-3.1-8b-128k-h200.yaml,
#      taken unchanged): `sglang-offload bench serve` on a real SGLang server started from it
#      (cold, L1/L2, and the L3 triples after a restart, with the L3 target verdict) at
#      SERVE_LENGTHS tokens, into $OUT/bench-serve.txt + bench-serve.json; skipped, with the
#      reason, where SGLang does not import or the file's model is not on local disk (no network).
#      Then the seed's configuration: the same bench serve with --kv-cache-dtype fp8_e4m3 at
#      FP8_LENGTHS (default 131008: a 128K-token prefix), into $OUT/bench-serve-fp8.txt + .json,
#      and the two side by side at that length (scripts/gpu_proof.py --fp8-summary: the L3's
#      bytes per block, cold vs L3 hit, bf16 vs fp8) in $OUT/fp8-summary.txt.
#   5. with --config FILE --workload: then `sglang-offload bench workload` from the same file (no
#      L3, SGLang's file L3 and ours, each restarted halfway; SGLang's own client, many users on
#      long shared prefixes, multi-turn), WORKLOAD_ARGS, into $OUT/bench-workload.txt + .json.
#      Six server starts of the file's model: longer than the proof's few minutes, so opt-in.
#   6. with --config FILE --unique: `sglang-offload bench workload --unique --tiers none,ours`
#      from the same file: what the tier costs where no prefix ever repeats (every prompt its own,
#      so ours writes every page back and serves nothing): ours against no L3 of the same round,
#      throughput and mean TTFT against the targets (>= 0.97x, <= 1.05x) and the bytes ours wrote,
#      UNIQUE_ARGS, into $OUT/bench-unique.txt + .json. Two server starts, one round: opt-in too.
#
#   bash scripts/gpu-proof.sh [--config FILE [--workload] [--unique]]   on the GPU machine
#   bash scripts/gpu-proof.sh --dry-run [--config FILE [--workload] [--unique]]   anywhere: install into the
#                          target, run a tiny model on the CPU, skip the GPU parts with the reason;
#                          with --config, check the file and print the SGLang command and the bench
#                          serve (and bench workload) command
# Environment: PYTHON (default: python3 with torch, else .venv/bin/python), OUT, WHEELS (default
# .whl), TARGET (default /tmp/sglang-offload-proof-site), CACHE_DIR (the store, on local disk),
# SERVE_LENGTHS (default 8192,32768,131008: 128K less a page, so 8 new tokens fit a 131072
# context), SERVE_TIMEOUT (seconds, default 1800; each of the two bench serve runs), FP8_LENGTHS
# (default 131008), WORKLOAD_ARGS (bench workload's options, default
# 8 shared 32K-token prefixes x 8 users x 3 turns, 16 in flight, L1 128K tokens, L2 1.5x that:
# below the ~310K-token working set), WORKLOAD_TIMEOUT (seconds, default 5400), UNIQUE_ARGS
# (default 16 unique prompts of 8,192 tokens, 4 in flight, 16 generated: ~16 GiB written back
# with Llama-3.1-8B's 128 KiB per token), UNIQUE_TIMEOUT (seconds, default 1200).
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
workload=0
unique=0
config=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --workload) workload=1 ;;
    --unique) unique=1 ;;
    --config) [ $# -ge 2 ] || { echo "gpu-proof: error: --config needs a FILE" >&2; exit 2; }
              config="$2"; shift ;;
    *) echo "gpu-proof: error: unknown argument $1 (use --dry-run, --config FILE, --workload, --unique)" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$config" ] && [ ! -f "$config" ]; then
  echo "gpu-proof: error: --config $config: no such file" >&2
  exit 2
fi
SERVE_LENGTHS="${SERVE_LENGTHS:-8192,32768,131008}"
SERVE_TIMEOUT="${SERVE_TIMEOUT:-1800}"
FP8_LENGTHS="${FP8_LENGTHS:-131008}"
WORKLOAD_ARGS="${WORKLOAD_ARGS:---groups 8 --users 8 --turns 3 --prefix-tokens 32768 --question-tokens 256 --output-tokens 16 --concurrency 16 --l1-tokens 131072 --l2-ratio 1.5 --seed 1}"
WORKLOAD_TIMEOUT="${WORKLOAD_TIMEOUT:-5400}"
UNIQUE_ARGS="${UNIQUE_ARGS:---groups 2 --users 4 --turns 2 --prefix-tokens 8128 --question-tokens 64 --output-tokens 16 --concurrency 4 --seed 1}"
UNIQUE_TIMEOUT="${UNIQUE_TIMEOUT:-1200}"
if [ "$workload" = 1 ] && [ -z "$config" ]; then
  echo "gpu-proof: error: --workload needs --config FILE (the deployment its servers start from)" >&2
  exit 2
fi
if [ "$unique" = 1 ] && [ -z "$config" ]; then
  echo "gpu-proof: error: --unique needs --config FILE (the deployment its servers start from)" >&2
  exit 2
fi
WHEELS="${WHEELS:-.whl}"
TARGET="${TARGET:-/tmp/sglang-offload-proof-site}"
OUT="${OUT:-$PWD/gpu-proof-out}"
CACHE_DIR="${CACHE_DIR:-/tmp/sglang-offload-gpu-proof}"
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  "$PYTHON" -c "import torch" 2>/dev/null || PYTHON=.venv/bin/python
fi
mkdir -p "$OUT"
say() { echo "gpu-proof: $*"; }

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
  say "error: no wheels in $WHEELS: run scripts/gpu-wheels.sh where PyPI is reachable first" >&2
  exit 2
fi
rm -rf "$TARGET"
if "$PYTHON" -m pip --version >/dev/null 2>&1; then
  "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
    --find-links "$WHEELS" --target "$TARGET" "${wheels[@]}" || { say "error: pip install failed" >&2; exit 2; }
else                                     # no pip in that interpreter: a wheel is a zip to unpack
  say "no pip in $PYTHON: unpacking the wheels into $TARGET"
  "$PYTHON" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
    "$TARGET" "${wheels[@]}" || exit 2
fi
export PYTHONPATH="$TARGET:$PWD${PYTHONPATH:+:$PYTHONPATH}" UCX_MODULES='^ib'
say "installed ${#wheels[@]} wheels into $TARGET with $PYTHON ($("$PYTHON" -V 2>&1))"
"$PYTHON" - <<'PY' || { say "error: kvikio does not import from the target" >&2; exit 2; }
import kvikio, torch
print(f"gpu-proof: kvikio {kvikio.__version__}; torch {torch.__version__} (CUDA {torch.version.cuda})")
PY

serve_cmd=("$PYTHON" -m offload.cli bench serve --config "$config" --lengths "$SERVE_LENGTHS"
           --repeat 3 --dir "$CACHE_DIR" --json)
fp8_cmd=("$PYTHON" -m offload.cli bench serve --config "$config" --lengths "$FP8_LENGTHS"
         --repeat 3 --kv-cache-dtype fp8_e4m3 --dir "$CACHE_DIR" --json)
read -r -a workload_args <<< "$WORKLOAD_ARGS"
workload_cmd=("$PYTHON" -m offload.cli bench workload --config "$config" "${workload_args[@]}"
              --dir "$CACHE_DIR" --json)
read -r -a unique_args <<< "$UNIQUE_ARGS"
unique_cmd=("$PYTHON" -m offload.cli bench workload --config "$config" --unique --tiers none,ours
            "${unique_args[@]}" --dir "$CACHE_DIR" --json)
# `bench_step NAME LIMIT CMD...`: one benchmark on the deployment file (needs SGLang and the
# file's model on local disk); its table to stdout, all of it in $OUT/bench-NAME.txt, the --json
# object in bench-NAME.json, its log in bench-NAME.log
bench_step() {
  local name=$1 limit=$2 why
  shift 2
  why=$("$PYTHON" -c 'import sys; from offload.bench.serve_target import missing_for_serve
why = missing_for_serve(sys.argv[1]); print(why or "ok"); sys.exit(1 if why else 0)' "$config" 2>&1) ||
    { say "skip: bench $name ($why)"; return 0; }
  say "bench $name: $*"
  mkdir -p "$CACHE_DIR"
  timeout "$limit" "$@" > "$OUT/bench-$name.txt" 2> "$OUT/bench-$name.log"
  local step_rc=$?
  sed -n '/^{/q;p' "$OUT/bench-$name.txt"
  sed -n '/^{/,$p' "$OUT/bench-$name.txt" > "$OUT/bench-$name.json"
  say "bench $name exit $step_rc (table: $OUT/bench-$name.txt, log: $OUT/bench-$name.log)"
  return "$step_rc"
}

rc=0
if [ "$dry" = 1 ]; then
  say "skip: the gpu-marked tests (--dry-run: no GPU)"
  "$PYTHON" scripts/gpu_proof.py --dry-run --out "$OUT" --cache-dir "$CACHE_DIR" || rc=$?
  if [ -n "$config" ]; then
    "$PYTHON" -m offload.cli config validate "$config" > /dev/null || exit 2
    say "the SGLang command launch would run from $config:"
    launch_cmd=$("$PYTHON" -m offload.cli launch --config "$config" --dry-run 2>/dev/null |
                 sed -n '/^Command$/{n;p}')
    if [ -z "$launch_cmd" ]; then      # launch refuses a GPU file on a machine without its GPUs
      fixture=tests/fixtures/hosts/h100-gds-nvme-listed
      say "(this machine cannot serve $config; as launch would on the fixture GPU host $fixture)"
      launch_cmd=$("$PYTHON" -m offload.cli launch --config "$config" --dry-run --root "$fixture" \
                   2>/dev/null | sed -n '/^Command$/{n;p}')
    fi
    echo "$launch_cmd"
    say "skip: bench serve (--dry-run); on the GPU machine: ${serve_cmd[*]}"
    say "skip: bench serve-fp8 (--dry-run); on the GPU machine: ${fp8_cmd[*]}"
    [ "$workload" = 1 ] && say "skip: bench workload (--dry-run); on the GPU machine: ${workload_cmd[*]}"
    [ "$unique" = 1 ] && say "skip: bench unique (--dry-run); on the GPU machine: ${unique_cmd[*]}"
  fi
  exit "$rc"
fi

command -v nvidia-smi >/dev/null && nvidia-smi -L
mapfile -t gpu_tests < <(grep -rl --include='test_*.py' -e 'pytest.mark.gpu' tests)
say "gpu-marked tests: ${gpu_tests[*]}"
timeout 240 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -rs \
  "${gpu_tests[@]}" 2>&1 | tee "$OUT/gpu-tests.txt" | tail -25
test_rc=${PIPESTATUS[0]}
say "gpu tests exit $test_rc (log: $OUT/gpu-tests.txt)"
timeout 420 "$PYTHON" scripts/gpu_proof.py --out "$OUT" --cache-dir "$CACHE_DIR" || rc=$?
[ "$rc" = 0 ] && rc=$test_rc
if [ -z "$config" ]; then
  say "skip: bench serve (no --config FILE)"
else
  bench_step serve "$SERVE_TIMEOUT" "${serve_cmd[@]}" || { [ "$rc" = 0 ] && rc=1; }
  bench_step serve-fp8 "$SERVE_TIMEOUT" "${fp8_cmd[@]}" || { [ "$rc" = 0 ] && rc=1; }
  if [ -s "$OUT/bench-serve.json" ] && [ -s "$OUT/bench-serve-fp8.json" ]; then
    "$PYTHON" scripts/gpu_proof.py --fp8-summary "$OUT/bench-serve.json" \
      "$OUT/bench-serve-fp8.json" --tokens "$FP8_LENGTHS" | tee "$OUT/fp8-summary.txt"
  fi
fi
if [ "$workload" = 1 ]; then   # three tiers, each started twice: only when asked
  bench_step workload "$WORKLOAD_TIMEOUT" "${workload_cmd[@]}" || { [ "$rc" = 0 ] && rc=1; }
fi
if [ "$unique" = 1 ]; then     # no L3 and ours, one start each, every prompt its own
  bench_step unique "$UNIQUE_TIMEOUT" "${unique_cmd[@]}" || { [ "$rc" = 0 ] && rc=1; }
fi
exit "$rc"
