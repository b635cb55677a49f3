#!/usr/bin/env bash
# Node e2e on kind: the plugin's image on a real kubelet and API server, on the fake NVML library with 8 GPUs.
#
#   integration/kind/e2e.sh            build the image, create the cluster, run every check, delete the cluster
#   integration/kind/e2e.sh --keep     leave the cluster (kind delete cluster --name gpu-device-plugin-e2e)
#   integration/kind/e2e.sh --check    list missing prerequisites and exit
#
# Needs docker (or podman as docker), kind and kubectl on PATH. Environment: KIND_NODE_IMAGE (default
# kindest/node:v1.34.0: a Kubernetes whose kubelet has the ResourceHealthStatus feature gate), CLUSTER (cluster
# name), TIMEOUT (seconds per check, default 120).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cluster="${CLUSTER:-gpu-device-plugin-e2e}"
node_image="${KIND_NODE_IMAGE:-kindest/node:v1.34.0}"
image="gpu-device-plugin:e2e"
timeout="${TIMEOUT:-120}"
keep=false
check_only=false
faults=/run/gpu-device-plugin-e2e/faults
failures=0

usage() {
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
}

for arg in "$@"; do
    case "$arg" in
        --keep) keep=true ;;
        --check) check_only=true ;;
        -h | --help) usage; exit 0 ;;
        *) echo "e2e.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
    esac
done

missing=()
for tool in docker kind kubectl; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if command -v docker >/dev/null 2>&1 && ! docker info >/dev/null 2>&1; then
    missing+=("a running container engine (docker info fails)")
fi
if ((${#missing[@]} > 0)); then
    printf 'missing: %s\n' "${missing[@]}" >&2
    exit 1
fi
if $check_only; then
    echo "all prerequisites present: docker, kind, kubectl, a running container engine"
    exit 0
fi

pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# check DESCRIPTION COMMAND...: runs COMMAND every 2 s until it succeeds or TIMEOUT passes; one PASS/FAIL line.
check() {
    local what="$1"
    shift
    local deadline=$((SECONDS + timeout))
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            fail "$what (not within ${timeout}s)"
            return 1
        fi
        sleep 2
    done
    pass "$what"
}

cleanup() {
    if $keep; then
        echo "cluster kept: kind delete cluster --name $cluster"
    else
        kind delete cluster --name "$cluster" >/dev/null 2>&1 || true
    fi
}

k() { kubectl --context "kind-$cluster" "$@"; }

worker="$cluster-worker"
# Appends one line to the fake NVML's fault file on the node, as a driver event.
fault() { docker exec "$worker" sh -c "echo '$*' >> $faults"; }

allocatable_is() {
    [[ "$(k get node "$worker" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')" == "$1" ]]
}
condition_is() {
    [[ "$(k get node "$worker" -o jsonpath='{.status.conditions[?(@.type=="GPUUnhealthy")].status}')" == "$1" ]]
}
pod_device_health_is() { # ID HEALTH
    k get pod e2e-gpu -o jsonpath='{.status.containerStatuses[0].allocatedResourcesStatus[*].resources[*]}' |
        grep -q "\"resourceID\":\"$1\",\"health\":\"$2\"" ||
        k get pod e2e-gpu -o jsonpath='{.status.containerStatuses[0].allocatedResourcesStatus[*].resources[*]}' |
        grep -q "\"health\":\"$2\",\"resourceID\":\"$1\""
}
event_with() { # REASON OBJECT TEXT
    k get events -A --field-selector "reason=$1,involvedObject.name=$2" -o jsonpath='{.items[*].message}' |
        grep -q "$3"
}
pod_events_contain() {
    k get events --field-selector involvedObject.name=e2e-gpu -o jsonpath='{.items[*].message}' | grep -q "$1"
}
plugin_ready() {
    [[ "$(k -n kube-system get pods -l app.kubernetes.io/name=gpu-device-plugin \
        -o jsonpath='{.items[*].status.conditions[?(@.type=="Ready")].status}')" == "True" ]]
}
container_running() {
    [[ -n "$(k get pod e2e-gpu -o jsonpath='{.status.containerStatuses[0].state.running}')" ]]
}

echo "== image $image"
docker build -t "$image" "$root"

echo "== cluster $cluster ($node_image)"
trap cleanup EXIT
config="$(mktemp)"
cat >"$config" <<'EOF'
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
featureGates:
  ResourceHealthStatus: true
nodes:
  - role: control-plane
  - role: worker
EOF
kind create cluster --name "$cluster" --image "$node_image" --config "$config" --wait 120s
rm -f "$config"
kind load docker-image "$image" --name "$cluster"
k label node "$worker" nvidia.com/gpu.present=true --overwrite
k apply -k "$root/manifests/overlays/kind-e2e"
check "plugin pod Ready" plugin_ready

check "node allocatable nvidia.com/gpu = 8" allocatable_is 8

k apply -f - <<'EOF'
apiVersion: v1
kind: Pod
metadata:
  name: e2e-gpu
spec:
  restartPolicy: Always
  containers:
    - name: main
      image: busybox:1.37
      # Runs until /tmp/exit exists, then exits 1 (the check restarts it that way).
      command: ["sh", "-c", "while [ ! -e /tmp/exit ]; do sleep 1; done; exit 1"]
      resources:
        limits:
          nvidia.com/gpu: 2
EOF
check "pod with 2 GPUs running" container_running
visible="$(k exec e2e-gpu -- printenv NVIDIA_VISIBLE_DEVICES || true)"
IFS=, read -r -a uuids <<<"$visible"
if ((${#uuids[@]} == 2)) && [[ "${uuids[0]}" == GPU-* && "${uuids[1]}" == GPU-* ]]; then
    pass "NVIDIA_VISIBLE_DEVICES has 2 UUIDs ($visible)"
else
    fail "NVIDIA_VISIBLE_DEVICES has 2 UUIDs (got '$visible')"
    exit 1
fi
gpu="${uuids[0]}"

echo "== XID 79 on $gpu"
fault "xid $gpu 79"
check "allocatable 7" allocatable_is 7
check "pod's allocatedResourcesStatus: $gpu Unhealthy" pod_device_health_is "$gpu" Unhealthy
check "GPUUnhealthy Event on the pod with the message" event_with GPUUnhealthy e2e-gpu "XID 79"
check "GPUUnhealthy Event on the node" event_with GPUUnhealthy "$worker" "XID 79"
check "node condition GPUUnhealthy True" condition_is True

echo "== container restart on the Unhealthy GPU"
k exec e2e-gpu -- touch /tmp/exit || true
check "PreStartContainer refusal with the message in the pod's events" pod_events_contain "XID 79"

echo "== plugin pod deleted"
k -n kube-system delete pod -l app.kubernetes.io/name=gpu-device-plugin --wait=true
check "new plugin pod Ready" plugin_ready
check "still allocatable 7 (checkpoint)" allocatable_is 7

echo "== kubelet restarted"
docker exec "$worker" systemctl restart kubelet
check "node Ready again" k wait --for=condition=Ready "node/$worker" --timeout=5s
check "still allocatable 7 after the kubelet restart" allocatable_is 7

echo "== recovery: the driver's recovery action 1 -> 0"
fault "action $gpu 1"
fault "action $gpu 0"
check "allocatable 8" allocatable_is 8
check "node condition GPUUnhealthy False" condition_is False
check "GPURecovered Event on the node" event_with GPURecovered "$worker" "$gpu"
check "the container starts again on the recovered GPU" container_running

if ((failures > 0)); then
    echo "e2e: $failures check(s) failed"
    exit 1
fi
echo "e2e: every check passed"
