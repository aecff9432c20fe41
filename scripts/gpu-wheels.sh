#!/usr/bin/env bash
# Downloads, where PyPI is reachable, exactly the wheels the GPU proof needs that a lent GPU machine
# lacks (it has no network: torch with CUDA 13, cupy-cuda13x, nvidia-cufile, numpy, pytest ... only),
# for Python 3.12 / manylinux x86_64, into .whl/ (ignored by git; carried to the GPU machine):
#   kvikio-cu13 + libkvikio-cu13 (the gds path), rapids-logger + cuda-pathfinder (libkvikio's own
#   small requirements), packaging (kvikio's). kvikio's cupy and cuda-toolkit[cufile] requirements
#   are the machine's own cupy-cuda13x and nvidia-cufile, so scripts/gpu-proof.sh installs --no-deps.
#
#   bash scripts/gpu-wheels.sh [DEST]        (default .whl; about 4 MiB; refuses above 48 MiB)
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
KVIKIO="${KVIKIO_VERSION:-26.10.0}"
py=.venv/bin/python
[ -x "$py" ] || py=python3
mkdir -p "$dest"
"$py" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform any \
  -d "$dest" \
  "kvikio-cu13==$KVIKIO" "libkvikio-cu13==$KVIKIO" "rapids-logger==0.3.*" cuda-pathfinder packaging \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
total=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
ls -l "$dest"/*.whl
echo "gpu-wheels: $(ls "$dest"/*.whl | wc -l) wheels, $((total / 1024)) KiB in $dest"
if [ "$total" -gt $((48 << 20)) ]; then
  echo "gpu-wheels: error: more than 48 MiB (one device call carries at most 64 MiB)" >&2
  exit 1
fi
