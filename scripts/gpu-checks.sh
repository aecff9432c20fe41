#!/usr/bin/env bash
# The GPU checks, as one prepared script for a lent GPU machine (see README "GPU checks").
# Installs the GPU extras into the existing .venv (kvikio, full SGLang is not needed), then runs
# every test marked `gpu`, the detection report and a short store benchmark on local disk.
set -uo pipefail
cd "$(dirname "$0")/.."
export UCX_MODULES=^ib
py=.venv/bin/python
[ -x "$py" ] || { python3 -m venv .venv && py=.venv/bin/python; }
$py -m pip install -q -e '.[test,gds]' 2>&1 | tail -2
nvidia-smi -L || true
$py -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tail -30
.venv/bin/sglang-offload detect --cache-dir "${CACHE_DIR:-/tmp/sglo-gpu-check}" || true
.venv/bin/sglang-offload bench store --dir "${CACHE_DIR:-/tmp}" --total 512MiB \
  --sizes 2MiB,8MiB,16MiB --lookup-blocks 0 || true
