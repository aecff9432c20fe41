#!/bin/sh
# Container entrypoint: print the hardware report, then exec `sglang-offload launch`.
#
#   <image> [SGLANG_FLAG ...]      extra SGLang flags, appended last (they win over the file)
#   <image> COMMAND [ARG ...]      run COMMAND instead (e.g. `sglang-offload detect --json`, `sh`)
#
# Environment (declared here and in docker/Dockerfile):
#   SGLANG_OFFLOAD_CONFIG   deployment file (default /etc/sglang-offload/config.yaml)
#   DRY_RUN=1               print the decision, the effective config and the command; do not start
#                           (1/true/yes/on; 0/false/no/off or unset: start; anything else: exit 2)
#   SGLANG_OFFLOAD_PYTHON   interpreter that runs SGLang (default python3)
set -eu

CONFIG="${SGLANG_OFFLOAD_CONFIG:-/etc/sglang-offload/config.yaml}"
PYTHON="${SGLANG_OFFLOAD_PYTHON:-python3}"

case "${1:-}" in
    ""|-*) ;;                               # no arguments, or SGLang flags: launch
    *) exec "$@" ;;                         # any other command runs as given
esac

if [ ! -r "$CONFIG" ]; then
    echo "error: no deployment config at $CONFIG: mount one" \
         "(-v ./deploy.yaml:$CONFIG:ro) or set SGLANG_OFFLOAD_CONFIG" >&2
    exit 2
fi

# The report goes first in the log. Exit 1 means the file asks for a path that cannot work
# here: launch below refuses with the same reason, so only a bad config (2) stops here.
rc=0
sglang-offload detect --config "$CONFIG" || rc=$?
[ "$rc" -le 1 ] || exit "$rc"

DRY=""
case "$(printf '%s' "${DRY_RUN:-0}" | tr '[:upper:]' '[:lower:]')" in
    0|false|no|off|"") ;;
    1|true|yes|on) DRY="--dry-run" ;;
    *) echo "error: DRY_RUN='$DRY_RUN' is not a yes/no value; use 1/true/yes/on or" \
            "0/false/no/off" >&2
       exit 2 ;;
esac
if [ $# -gt 0 ]; then
    exec sglang-offload launch --config "$CONFIG" --python "$PYTHON" $DRY -- "$@"
fi
exec sglang-offload launch --config "$CONFIG" --python "$PYTHON" $DRY
