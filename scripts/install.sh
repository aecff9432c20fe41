#!/usr/bin/env bash
# Installs everything this project needs on a fresh CPU machine (Debian, Python 3.11, root):
#   - Debian packages the tests drive: redis-server/redis-tools, buildah + debootstrap (the image
#     test), patch (the patched wheel), openssl (TLS certificates);
#   - .venv with SGLang's own pins: torch 2.14.1 + torchvision 0.29.1;
#   - SGLang 0.5.23 with --no-deps plus the minimal list in distro/sglang-cpu-deps.txt
#     (on a GPU host use `pip install -e '.[sglang,gds,dpu]'` instead: the full pinned SGLang);
#   - this project, editable, with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v redis-cli >/dev/null || need+=(redis-tools)
command -v buildah >/dev/null || need+=(buildah)          # tests/docker/test_image.py
command -v debootstrap >/dev/null || need+=(debootstrap)  # its stand-in base image
command -v patch >/dev/null || need+=(patch)              # distro/build_wheel.py applies patches/
command -v openssl >/dev/null || need+=(openssl)          # the Redis TLS test makes certificates
if ((${#need[@]})); then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${pip[@]}" torch==2.14.1 torchvision==0.29.1
"${pip[@]}" --no-deps sglang==0.5.23
"${pip[@]}" -r distro/sglang-cpu-deps.txt
"${pip[@]}" -e '.[test,redis,metrics,dpu]'
.venv/bin/python -c "import offload, sglang.srt.mem_cache.hicache_storage" && echo "install: ok"
