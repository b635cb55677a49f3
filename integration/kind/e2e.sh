#!/usr/bin/env bash
# Node e2e on kind: integration/e2e/run.sh with its kind provider (a control plane and a worker, made for the run).
#
#   integration/kind/e2e.sh            build the image, create the cluster, run every check, delete the cluster
#   integration/kind/e2e.sh --keep     leave the cluster (kind delete cluster --name gpu-device-plugin-e2e)
#   integration/kind/e2e.sh --check    list missing prerequisites and exit
#
# Every option of run.sh is taken (--road, --no-build); see `integration/e2e/run.sh --help`. Environment:
# KIND_NODE_IMAGE (default kindest/node:v1.34.0), CLUSTER (cluster name), TIMEOUT (seconds per check, default 120).
set -euo pipefail
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
    awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
exec "$(cd "$(dirname "${BASH_SOURCE[0]}")/../e2e" && pwd)/run.sh" kind "$@"
