#!/usr/bin/env bash
# The GPU proof, as one prepared script for a lent GPU machine (no network, one H200, <= 8 minutes):
#   1. installs the wheels of .whl/ (scripts/gpu-wheels.sh) with `pip --no-index --no-deps
#      --target DIR`: nothing is downloaded; the machine's own torch, cupy and nvidia-cufile are used;
#   2. runs every test marked `gpu` (the files that carry the marker);
#   3. measures the headline (scripts/gpu_proof.py): prefill of 32K / 64K / 128K-token prompts on a
#      Llama-3.1-8B-shaped model against loading the same KV bytes from the block store through cpu
#      staging and gds; writes gpu-proof.json + gpu-proof.png to $OUT (default ./gpu-proof-out).
#
#   bash scripts/gpu-proof.sh              on the GPU machine
#   bash scripts/gpu-proof.sh --dry-run    anywhere: install into the target, run a tiny model on
#                                          the CPU, skip the GPU parts with the reason
# Environment: PYTHON (default: python3 with torch, else .venv/bin/python), OUT, WHEELS (default
# .whl), TARGET (default /tmp/sglang-offload-proof-site), CACHE_DIR (the store, on local disk).
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
[ "${1:-}" = "--dry-run" ] && dry=1
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

rc=0
if [ "$dry" = 1 ]; then
  say "skip: the gpu-marked tests (--dry-run: no GPU)"
  "$PYTHON" scripts/gpu_proof.py --dry-run --out "$OUT" --cache-dir "$CACHE_DIR" || rc=$?
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
exit "$rc"
