#!/usr/bin/env bash
# Node e2e: the plugin's image, deployed from manifests/ as a user deploys it, on a real kubelet, API server and
# scheduler, on the fake NVML library; the device plugin road, then the DRA road.
#
#   integration/e2e/run.sh PROVIDER [--road dp|dra|all] [--keep] [--no-build] [--check]
#
# Providers (integration/e2e/providers/PROVIDER.sh) supply the kubeconfig, the image's loading, a shell on
# the node (fault files under /run/gpu-device-plugin-e2e) and a kubelet restart:
#@PROVIDERS@
#
# --road      which road to check (default all: dp, then dra)
# --keep      leave what the run deployed (and kind's cluster) in place
# --no-build  use target/release as it is (default: cargo build --release first)
# --check     list missing prerequisites and exit
# --measure   also measure (provider local): fault -> pod status by an API watch (MEASURE_COUNT faults, default
#             20, each with 1.5 s since the pod's last status update, and 5 right after one), the plugin pod's
#             RSS and CPU at rest (MEASURE_REST seconds, default 60), and, when the API server writes an audit
#             log (AUDIT_LOG), the API requests of the plugin's service account per fault and while idle
#
# One PASS/FAIL line per check with what it measured, then `N passed, M failed`; exits non-zero on any
# failure. Every wait is bounded (TIMEOUT seconds per check, default 120). Everything the run makes is
# removed at the end (a trap), unless --keep.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
timeout="${TIMEOUT:-120}"
IMAGE_REF="docker.io/library/gpu-device-plugin:e2e"
NODE_DIR=/run/gpu-device-plugin-e2e
STATE_DIR=/var/lib/gpu-device-plugin
CREATED_BY="app.kubernetes.io/created-by=gpu-device-plugin-e2e"

usage() {
    local providers
    providers="$(for p in "$here"/providers/*.sh; do
        # shellcheck disable=SC1090
        (source "$p" && provider_usage)
    done)"
    awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0" | sed 's/^# \{0,1\}//' | while IFS= read -r line; do
        if [[ "$line" == "@PROVIDERS@" ]]; then printf '%s\n' "$providers"; else printf '%s\n' "$line"; fi
    done
}

provider=""
road=all
keep=false
build=true
check_only=false
measure=false
while (($# > 0)); do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --keep) keep=true ;;
        --no-build) build=false ;;
        --check) check_only=true ;;
        --measure) measure=true ;;
        --road)
            shift
            road="${1:-}"
            [[ "$road" =~ ^(dp|dra|all)$ ]] || { echo "run.sh: --road takes dp, dra or all, not '$road'" >&2; exit 2; }
            ;;
        -*) echo "run.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
        *)
            [[ -z "$provider" ]] || { echo "run.sh: one provider, not '$provider' and '$1'" >&2; exit 2; }
            provider="$1"
            ;;
    esac
    shift
done
if [[ -z "$provider" ]]; then
    echo "run.sh: name a provider (see --help)" >&2
    exit 2
fi
if [[ ! -f "$here/providers/$provider.sh" ]]; then
    echo "run.sh: no provider '$provider' (see --help)" >&2
    exit 2
fi
work="$(mktemp -d)"
# shellcheck disable=SC1090
source "$here/providers/$provider.sh"

missing=()
for tool in jq python3; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]} > 0)); then
    printf 'missing: %s\n' "${missing[@]}" >&2
    rm -rf "$work"
    exit 1
fi
if ! provider_check; then
    rm -rf "$work"
    exit 1
fi
if $check_only; then
    echo "all prerequisites present for provider $provider"
    rm -rf "$work"
    exit 0
fi

# ---------------------------------------------------------------------------------------------------------
# Results

passed=0
failed=0
now_ms() { local t="${EPOCHREALTIME/./}"; echo $((t / 1000)); }
secs() { printf '%d.%03d s' $(($1 / 1000)) $(($1 % 1000)); }
pass() { echo "PASS: $*"; passed=$((passed + 1)); }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }

# wait_for SECONDS COMMAND...: runs COMMAND every 0.5 s until it succeeds (0) or SECONDS pass (1).
wait_for() {
    local limit_ms=$(($1 * 1000)) start
    shift
    start="$(now_ms)"
    until "$@" >/dev/null 2>&1; do
        if (($(now_ms) - start >= limit_ms)); then
            return 1
        fi
        sleep 0.5
    done
}

# check [--since T0_MS] [--within SECONDS] DESCRIPTION COMMAND...: one PASS/FAIL line with the time it took,
# counted from T0_MS (default: now).
check() {
    local t0 limit="$timeout"
    t0="$(now_ms)"
    while [[ "$1" == --* ]]; do
        case "$1" in
            --since) t0="$2" ;;
            --within) limit="$2" ;;
        esac
        shift 2
    done
    local what="$1"
    shift
    if wait_for "$limit" "$@"; then
        pass "$what ($(secs $(($(now_ms) - t0))))"
    else
        fail "$what (not within ${limit} s)"
        return 1
    fi
}

k() { kubectl --request-timeout=20s "$@"; }

# ---------------------------------------------------------------------------------------------------------
# Cleanup: everything the run made, in reverse; bounded.

node_dir_existed=""
state_dir_existed=""
deployed=""
image_loaded=false
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if $keep; then
        echo "kept: the deployment ($work/kustomization.yaml), the test pods and the image"
    else
        k delete pods,resourceclaims,resourceclaimtemplates -A -l "$CREATED_BY" --ignore-not-found \
            --grace-period=1 --wait=true --timeout=60s >/dev/null 2>&1
        [[ -n "$deployed" ]] && undeploy
        if [[ -n "${NODE:-}" ]]; then
            k label node "$NODE" nvidia.com/gpu.present- >/dev/null 2>&1
            k annotate node "$NODE" gpu-device-plugin/fenced- >/dev/null 2>&1
            # The plugin's node condition (Unknown, PluginStopped, once it stopped): gone with the plugin.
            # shellcheck disable=SC2016 # `$patch` is the strategic merge patch's directive
            k patch node "$NODE" --subresource=status --type=strategic \
                -p '{"status":{"conditions":[{"type":"GPUUnhealthy","$patch":"delete"}]}}' >/dev/null 2>&1
        fi
        [[ "$node_dir_existed" == no ]] && node_sh "rm -rf $NODE_DIR"
        [[ "$state_dir_existed" == no ]] && node_sh "rm -rf $STATE_DIR"
        $image_loaded && provider_unload_image
    fi
    provider_down
    rm -rf "$work"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------------------------------------------------
# The image and the deployment

# The kustomization a user would write: the road's manifests as they are, the image, the fake NVML (and what a
# loopback-only node needs, for providers that say so).
write_kustomization() { # ROAD
    local rel base gpus
    rel="$(realpath --relative-to="$work" "$root")"
    if [[ "$1" == dra ]]; then base="manifests/overlays/dra"; gpus="gpus-dra.json"; else base="manifests/base"; gpus="gpus.json"; fi
    {
        echo "apiVersion: kustomize.config.k8s.io/v1beta1"
        echo "kind: Kustomization"
        echo "resources:"
        echo "  - $rel/$base"
        echo "components:"
        echo "  - $rel/integration/e2e/components/fake-nvml"
        [[ "$LOOPBACK" == true ]] && echo "  - $rel/integration/e2e/components/loopback"
        echo "images:"
        echo "  - name: registry.example.com/gpu-device-plugin"
        echo "    newName: gpu-device-plugin"
        echo "    newTag: e2e"
        echo "patches:"
        echo "  - patch: |-"
        echo "      apiVersion: apps/v1"
        echo "      kind: DaemonSet"
        echo "      metadata: {name: gpu-device-plugin, namespace: kube-system}"
        echo "      spec: {template: {spec: {containers: [{name: gpu-device-plugin, env: [{name: FAKE_NVML_CONFIG, value: /etc/fake-nvml/$gpus}]}]}}}"
    } >"$work/kustomization.yaml"
}

deploy() { # ROAD
    write_kustomization "$1"
    deployed="$1"
    k apply -k "$work" >"$work/apply.log" 2>&1 || { cat "$work/apply.log"; return 1; }
}

undeploy() {
    k delete -k "$work" --ignore-not-found --wait=true --timeout=60s >/dev/null 2>&1
    deployed=""
}

plugin_pods() {
    k -n kube-system get pods -l app.kubernetes.io/name=gpu-device-plugin -o json
}
plugin_ready() {
    [[ "$(plugin_pods | jq '[.items[] | select(.metadata.deletionTimestamp == null)
        | select(any(.status.conditions[]?; .type == "Ready" and .status == "True"))] | length')" == 1 ]] &&
        [[ "$(plugin_pods | jq '.items | length')" == 1 ]]
}
# The DaemonSet rolled from pod FIRST: one pod, Ready, another. (`kubectl rollout status` says done for a
# surge DaemonSet as soon as the new pod is scheduled while the old one is still available.)
rolled_from() { plugin_ready && [[ "$(plugin_pod_name)" != "$1" ]]; }
plugin_pod_name() {
    plugin_pods | jq -r '[.items[] | select(.metadata.deletionTimestamp == null)][0].metadata.name'
}

node_json() { k get node "$NODE" -o json; }
allocatable() { node_json | jq -r '.status.allocatable["nvidia.com/gpu"] // "none"'; }
allocatable_is() { [[ "$(allocatable)" == "$1" ]]; }
condition() { # FIELD
    node_json | jq -r --arg f "$1" '(.status.conditions[]? | select(.type == "GPUUnhealthy") | .[$f]) // "none"'
}
condition_is() { [[ "$(condition status)" == "$1" ]]; }
condition_reason_is() { [[ "$(condition reason)" == "$1" ]]; }
condition_says() { condition message | grep -qF -- "$1"; }
node_ready() {
    [[ "$(node_json | jq -r '.status.conditions[] | select(.type == "Ready") | .status')" == True ]]
}
pod_json() { k get pod "$1" -o json; }
pod_phase_is() { [[ "$(pod_json "$1" | jq -r .status.phase)" == "$2" ]]; }
container_running() {
    [[ "$(pod_json "$1" | jq -r '.status.containerStatuses[0].state.running != null')" == true ]]
}
# The health of RESOURCE ID (a GPU UUID, or a DRA CDI ID) in the pod's allocatedResourcesStatus.
pod_resource() { # POD ID FIELD
    pod_json "$1" | jq -r --arg id "$2" --arg f "$3" \
        '[.status.containerStatuses[0].allocatedResourcesStatus[]?.resources[]? | select(.resourceID == $id) | .[$f]][0] // "none"'
}
pod_health_is() { [[ "$(pod_resource "$1" "$2" health)" == "$3" ]]; }
events_of() { # NAME [REASON]
    local sel="involvedObject.name=$1"
    [[ -n "${2:-}" ]] && sel="$sel,reason=$2"
    k get events -A --field-selector "$sel" -o json | jq -r '.items[] | .reason + ": " + .message'
}
event_with() { events_of "$1" "$2" | grep -qF -- "$3"; }
describe_has() { k describe pod "$1" | grep -qF -- "$2"; }
fault() { node_sh "echo '$*' >> $NODE_DIR/faults"; }
plugin_log_count() { # TEXT: how often it is in the plugin pod's log
    k -n kube-system logs "$(plugin_pod_name)" 2>/dev/null | grep -cF -- "$1"
}

new_pod() { # NAME then the spec's YAML on stdin, after `spec:`
    { cat <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $1
  namespace: default
  labels: {app.kubernetes.io/created-by: gpu-device-plugin-e2e}
spec:
  hostNetwork: true
  enableServiceLinks: false
  terminationGracePeriodSeconds: 1
EOF
      cat; } | k apply -f - >/dev/null
}

build_image() {
    if $build; then
        echo "== cargo build --release"
        (cd "$root" && cargo build --release --locked -p gpu-device-plugin -p fake-nvml) >"$work/build.log" 2>&1 ||
            { tail -20 "$work/build.log"; return 1; }
    fi
    python3 "$here/mkimage.py" "$work/image.tar" --target "$root/target/release" --name "$IMAGE_REF" || return 1
    provider_load_image "$work/image.tar" || return 1
    image_loaded=true
}

# ---------------------------------------------------------------------------------------------------------
# Measurements (--measure): MEASURE lines, no PASS/FAIL (targets live in BENCHMARKS.md, not in a check)

measure_line() { echo "MEASURE: $*"; }

# The API requests of the plugin's service account in the audit log (integration/e2e/audit-policy.yaml: one
# line per request at ResponseComplete, a watch counted at ResponseStarted) since line FROM.
audit_lines() { wc -l <"$AUDIT_LOG"; }
audit_count() { # FROM
    tail -n +"$(($1 + 1))" "$AUDIT_LOG" | jq -c 'select(.user.username == "system:serviceaccount:kube-system:gpu-device-plugin")
        | select((.verb == "watch" and .stage == "ResponseStarted") or (.verb != "watch" and .stage == "ResponseComplete"))' | wc -l
}
audit_summary() { # FROM
    tail -n +"$(($1 + 1))" "$AUDIT_LOG" | jq -r 'select(.user.username == "system:serviceaccount:kube-system:gpu-device-plugin")
        | select((.verb == "watch" and .stage == "ResponseStarted") or (.verb != "watch" and .stage == "ResponseComplete"))
        | .verb + " " + (.objectRef.resource // "") + (if .objectRef.subresource then "/" + .objectRef.subresource else "" end)' |
        sort | uniq -c | sort -rn | awk '{printf "%s%s %s×%s", (NR > 1 ? ", " : ""), $2, $3, $1}'
}
audit_agent() {
    tail -n 2000 "$AUDIT_LOG" | jq -r 'select(.user.username == "system:serviceaccount:kube-system:gpu-device-plugin") | .userAgent' | sort -u | head -3 | tr '\n' ' '
}

# RSS and CPU of the plugin's container at rest (no fault, no API traffic of ours) for MEASURE_REST seconds.
measure_rest() {
    local cid pid rss t1 t2 secs_rest="${MEASURE_REST:-60}"
    cid="$(k -n kube-system get pod "$(plugin_pod_name)" -o jsonpath='{.status.containerStatuses[0].containerID}')"
    cid="${cid#containerd://}"
    pid="$(node_sh "ctr -n k8s.io tasks ls" | awk -v id="$cid" '$1 == id {print $2}')"
    if [[ -z "$pid" ]]; then measure_line "RSS/CPU: no task for container $cid"; return; fi
    t1="$(node_sh "cut -d' ' -f14,15 /proc/$pid/stat" | awk '{print $1 + $2}')"
    sleep "$secs_rest"
    t2="$(node_sh "cut -d' ' -f14,15 /proc/$pid/stat" | awk '{print $1 + $2}')"
    rss="$(node_sh "grep VmRSS /proc/$pid/status" | awk '{print $2}')"
    measure_line "$1: plugin pod at rest: RSS $((rss / 1024)) MiB ($rss KiB), CPU $((t2 - t1)) ticks in ${secs_rest} s ($(awk -v t=$((t2 - t1)) -v s="$secs_rest" 'BEGIN {printf "%.3f", t / s}')% of one core)"
}

measure_road() { # ROAD POD UUID
    local from out count="${MEASURE_COUNT:-20}"
    if [[ "$provider" != local ]]; then measure_line "skipped: --measure needs the node's files here (provider local)"; return; fi
    echo "== measure ($1): fault -> pod status by an API watch, $count faults"
    [[ -n "${AUDIT_LOG:-}" && -f "$AUDIT_LOG" ]] && from="$(audit_lines)"
    out="$(python3 "$here/latency.py" --pod "$2" --uuid "$3" --fault-file "$NODE_DIR/faults" --road "$1" \
        --count "$count" --paced 5 2>&1)"
    awk '{print "  " $0}' <<<"$out"
    measure_line "$1: $(echo "$out" | tail -1)"
    if [[ -n "${from:-}" ]]; then
        measure_line "$1: API requests of the plugin's service account during $((count + 5)) faults and their recoveries: $(audit_count "$from") ($(audit_summary "$from")); user agent: $(audit_agent)"
    fi
    measure_rest "$1"
    if [[ -n "${AUDIT_LOG:-}" && -f "$AUDIT_LOG" ]]; then
        local idle="${MEASURE_IDLE:-300}"
        from="$(audit_lines)"
        sleep "$idle"
        measure_line "$1: API requests of the plugin's service account in ${idle} s idle (plus the rest above): $(audit_count "$from") ($(audit_summary "$from"))"
    fi
}

# ---------------------------------------------------------------------------------------------------------
# The device plugin road

gpu() { printf 'GPU-e2e00000-0000-4000-8000-%012d' "$1"; }
# The fault on $bad still shown after the plugin's pod changed: in the pod's status and in allocatable.
fault_kept() { pod_health_is e2e-gpu "$bad" Unhealthy && allocatable_is 7; }
registered_more_than() { (($(plugin_log_count "registered with the kubelet") > $1)); }
fault_kept_on_node() { allocatable_is 7 && condition_is True; }
running_on_bad() { container_running e2e-gpu && pod_health_is e2e-gpu "$bad" Unhealthy; }

road_dp() {
    echo "== device plugin road: manifests/base + the e2e components"
    deploy dp || { fail "kubectl apply -k (manifests/base)"; return; }
    check "DaemonSet's pod Ready" plugin_ready || return
    check "node condition GPUUnhealthy False, written through the service account's token and RBAC" condition_is False
    check "node allocatable nvidia.com/gpu = 8" allocatable_is 8 || return

    new_pod e2e-gpu <<EOF
  restartPolicy: Always
  containers:
    - name: main
      image: $POD_IMAGE
      imagePullPolicy: IfNotPresent
      # Says its GPUs, then runs until the node's $NODE_DIR/pod/exit exists, then exits 1.
      command: ["sh", "-c", "echo NVIDIA_VISIBLE_DEVICES=\$NVIDIA_VISIBLE_DEVICES; while [ ! -e /e2e/exit ]; do sleep 0.2; done; exit 1"]
      resources: {limits: {nvidia.com/gpu: 2}}
      volumeMounts: [{name: e2e, mountPath: /e2e, readOnly: true}]
  volumes: [{name: e2e, hostPath: {path: $NODE_DIR/pod, type: DirectoryOrCreate}}]
EOF
    check "pod with 2 GPUs Running" container_running e2e-gpu || return
    local visible uuids
    wait_for 30 bash -c "kubectl logs e2e-gpu 2>/dev/null | grep -q NVIDIA_VISIBLE_DEVICES="
    visible="$(k logs e2e-gpu | sed -n 's/^NVIDIA_VISIBLE_DEVICES=//p' | head -1)"
    IFS=, read -r -a uuids <<<"$visible"
    # The fake NVML's GPUs (components/fake-nvml/gpus.json): another device plugin of nvidia.com/gpu on the
    # node (one run by hand) would have allocated its own.
    if ((${#uuids[@]} == 2)) && [[ "${uuids[0]}" == GPU-e2e00000-* && "${uuids[1]}" == GPU-e2e00000-* ]]; then
        pass "the container's NVIDIA_VISIBLE_DEVICES has 2 of the plugin's UUIDs ($visible)"
    else
        fail "the container's NVIDIA_VISIBLE_DEVICES has 2 of the plugin's UUIDs (got '$visible')"
        return
    fi
    local bad="${uuids[0]}" t0
    echo "== XID 79 on $bad"
    t0="$(now_ms)"
    fault "xid $bad 79"
    check --since "$t0" "pod's allocatedResourcesStatus: $bad Unhealthy" pod_health_is e2e-gpu "$bad" Unhealthy
    check --since "$t0" "node condition GPUUnhealthy True" condition_is True
    check --since "$t0" "GPUUnhealthy Event on the pod, with the message" event_with e2e-gpu GPUUnhealthy "XID 79"
    check --since "$t0" "GPUUnhealthy Event on the node, with the message" event_with "$NODE" GPUUnhealthy "XID 79"
    check --since "$t0" "node allocatable 7" allocatable_is 7

    echo "== the container restarted on the Unhealthy GPU"
    t0="$(now_ms)"
    node_sh "mkdir -p $NODE_DIR/pod && touch $NODE_DIR/pod/exit"
    check --since "$t0" "the restart refused: the kubelet's Failed event has the message" event_with e2e-gpu Failed "XID 79"
    check --since "$t0" "the refusal in kubectl describe pod" describe_has e2e-gpu "Error: "
    node_sh "rm -f $NODE_DIR/pod/exit"

    echo "== fence by node annotation"
    local fenced
    fenced="$(for i in 0 1 2 3 4 5 6 7; do [[ " ${uuids[*]} " == *" $(gpu "$i") "* ]] || { gpu "$i"; break; }; done)"
    t0="$(now_ms)"
    k annotate node "$NODE" "gpu-device-plugin/fenced=$fenced=e2e fence" --overwrite >/dev/null
    check --since "$t0" "fence of $fenced by annotation: allocatable 6" allocatable_is 6
    check --since "$t0" "the condition's message names the fence" condition_says "e2e fence"
    t0="$(now_ms)"
    k annotate node "$NODE" gpu-device-plugin/fenced- >/dev/null
    check --since "$t0" "fence released: allocatable 7" allocatable_is 7

    echo "== kubectl rollout restart"
    local lowest=8 a first
    first="$(plugin_pod_name)"
    t0="$(now_ms)"
    k -n kube-system rollout restart ds/gpu-device-plugin >/dev/null
    # Every 0.5 s until the old pod is gone and the new one Ready (bounded): the lowest allocatable shown.
    local deadline=$(($(now_ms) + timeout * 1000))
    until rolled_from "$first" || (($(now_ms) > deadline)); do
        a="$(allocatable)"
        [[ "$a" =~ ^[0-9]+$ ]] && ((a < lowest)) && lowest="$a"
        sleep 0.5
    done
    if rolled_from "$first"; then pass "rollout done: the old pod gone, the new one Ready ($(secs $(($(now_ms) - t0))))"; else fail "rollout done within ${timeout} s"; fi
    # One node status period more (the kubelet reports allocatable every 10 s).
    for _ in $(seq 1 24); do
        a="$(allocatable)"
        [[ "$a" =~ ^[0-9]+$ ]] && ((a < lowest)) && lowest="$a"
        sleep 0.5
    done
    if ((lowest >= 7)); then pass "allocatable never below 7 during the rollout (lowest seen $lowest)"; else fail "allocatable never below 7 during the rollout (lowest seen $lowest)"; fi
    check "the fault kept after the rollout: $bad Unhealthy, allocatable 7" fault_kept

    echo "== the plugin's pod deleted"
    local old
    old="$(plugin_pod_name)"
    t0="$(now_ms)"
    k -n kube-system delete pod "$old" --wait=true --timeout=60s >/dev/null
    check --since "$t0" "a new plugin pod Ready" plugin_ready
    check --since "$t0" "the fault kept: $bad Unhealthy, allocatable 7" fault_kept

    echo "== recovery: the driver's recovery action 1 -> 0"
    t0="$(now_ms)"
    fault "action $bad 1"
    fault "action $bad 0"
    check --since "$t0" "$bad Healthy in the pod's status" pod_health_is e2e-gpu "$bad" Healthy
    check --since "$t0" "node condition GPUUnhealthy False" condition_is False
    check --since "$t0" "GPURecovered Event on the node" event_with "$NODE" GPURecovered "$bad"
    check --since "$t0" "node allocatable 8" allocatable_is 8
    # The kubelet's back-off for a container that failed to start, up to 5 min.
    check --since "$t0" --within 330 "the container runs again" container_running e2e-gpu

    echo "== the kubelet restarted, $bad Unhealthy again"
    local registered
    t0="$(now_ms)"
    fault "xid $bad 79"
    check --since "$t0" "XID 79 again: $bad Unhealthy, allocatable 7" fault_kept
    registered="$(plugin_log_count "registered with the kubelet")"
    t0="$(now_ms)"
    if restart_kubelet; then pass "kubelet restarted ($(secs $(($(now_ms) - t0))))"; else fail "kubelet restarted"; fi
    check --since "$t0" "node Ready" node_ready
    check --since "$t0" "the plugin registered again" registered_more_than "$registered"
    check --since "$t0" "the fault kept: node allocatable 7, condition True" fault_kept_on_node
    check --since "$t0" "the pod's container kept running, $bad Unhealthy in its status" running_on_bad
    t0="$(now_ms)"
    fault "action $bad 1"
    fault "action $bad 0"
    check --since "$t0" "recovered again: node allocatable 8" allocatable_is 8

    $measure && measure_road dp e2e-gpu "$bad"

    echo "== the DaemonSet deleted"
    t0="$(now_ms)"
    k -n kube-system delete ds gpu-device-plugin --wait=true --timeout=60s >/dev/null
    check --since "$t0" "node condition GPUUnhealthy Unknown, reason PluginStopped (docs/where-health-shows.md)" \
        condition_reason_is PluginStopped
    k delete pod e2e-gpu --grace-period=1 --wait=true --timeout=60s >/dev/null 2>&1
    undeploy
}

# ---------------------------------------------------------------------------------------------------------
# The DRA road

DRIVER=gpu.nvidia.com
slice_devices() {
    k get resourceslices -o json |
        jq --arg n "$NODE" --arg d "$DRIVER" '[.items[] | select(.spec.nodeName == $n and .spec.driver == $d) | .spec.devices[]]'
}
slice_device_count_is() { [[ "$(slice_devices | jq length)" == "$1" ]]; }
device_uuid() { slice_devices | jq -r --arg d "$1" '.[] | select(.name == $d) | .attributes.uuid.string'; }
device_taints() { # DEVICE: key=value:effect,...
    slice_devices | jq -r --arg d "$1" '[.[] | select(.name == $d) | .taints[]? | .key + "=" + (.value // "") + ":" + .effect] | join(",")'
}
device_tainted() { [[ "$(device_taints "$1")" == *"$2"* ]]; }
device_untainted() { [[ -z "$(device_taints "$1")" ]]; }
# The first resource of the pod's first container's allocatedResourcesStatus (a pod with one claim).
dra_resource() { # POD FIELD
    pod_json "$1" | jq -r --arg f "$2" '[.status.containerStatuses[0].allocatedResourcesStatus[]?.resources[]?][0][$f] // "none"'
}
dra_health_is() { [[ "$(dra_resource "$1" health)" == "$2" ]]; }
dra_message_has() { dra_resource "$1" message | grep -qF -- "$2"; }
pod_claim() { pod_json "$1" | jq -r '.status.resourceClaimStatuses[0].resourceClaimName // .spec.resourceClaims[0].resourceClaimName // "none"'; }
claim_devices() { # CLAIM: the allocated devices, comma separated
    k get resourceclaim "$1" -o json | jq -r '[.status.allocation.devices.results[]?.device] | join(",")'
}
claim_uid() { k get resourceclaim "$1" -o jsonpath='{.metadata.uid}'; }
claim_gone() { ! k get resourceclaim "$1" >/dev/null 2>&1; }
record_has() { node_sh "cat $STATE_DIR/dra-prepared-claims.json 2>/dev/null" | grep -qF -- "$1"; }
record_lacks() { ! record_has "$1"; }
pod_events_have() { events_of "$1" | grep -qF -- "$2"; }

claim_template() { # NAME DEVICECLASS CEL [COUNT]
    k apply -f - >/dev/null <<EOF
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: $1
  namespace: default
  labels: {app.kubernetes.io/created-by: gpu-device-plugin-e2e}
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly:
            deviceClassName: $2
            allocationMode: ExactCount
            count: ${4:-1}
            selectors:
              - cel:
                  expression: "$3"
EOF
}
claim_pod() { # NAME TEMPLATE
    new_pod "$1" <<EOF
  restartPolicy: Always
  resourceClaims:
    - name: gpu
      resourceClaimTemplateName: $2
  containers:
    - name: main
      image: $POD_IMAGE
      imagePullPolicy: IfNotPresent
      command: ["sh", "-c", "while true; do sleep 1; done"]
      resources: {claims: [{name: gpu}]}
EOF
}

# Samples the health of POD's one DRA resource until $work/stop-sampling exists; writes the longest time
# (ms) the pod's status did not say Healthy, counted from the last sample that did, to FILE.
sample_health_gap() { # POD FILE
    local last_ok worst=0 now h
    last_ok="$(now_ms)"
    while [[ ! -e "$work/stop-sampling" ]]; do
        h="$(dra_resource "$1" health 2>/dev/null)"
        now="$(now_ms)"
        if [[ "$h" == Healthy ]]; then
            last_ok="$now"
        elif ((now - last_ok > worst)); then
            worst=$((now - last_ok))
        fi
        sleep 0.2
    done
    echo "$worst" >"$2"
}
registration_sockets() { node_sh "ls /var/lib/kubelet/plugins_registry" 2>/dev/null | grep -c "^$DRIVER-.*-reg\.sock$"; }

# Runs COMMAND while sampling the health of POD: PASS when the longest gap is at most LIMIT_MS.
health_kept_through() { # WHAT POD LIMIT_MS COMMAND...
    local what="$1" pod="$2" limit="$3" gap
    shift 3
    rm -f "$work/stop-sampling" "$work/gap"
    sample_health_gap "$pod" "$work/gap" &
    local sampler=$!
    "$@"
    # Past the change: the kubelet's health stream and pod status settled.
    sleep 5
    touch "$work/stop-sampling"
    wait "$sampler"
    gap="$(cat "$work/gap" 2>/dev/null || echo 999999)"
    if ((gap <= limit)); then
        pass "$what: $pod's GPU health not shown for at most $(secs "$gap") (limit $(secs "$limit"))"
    else
        fail "$what: $pod's GPU health not shown for $(secs "$gap") (limit $(secs "$limit"))"
    fi
}

dra_rollout() {
    local deadline=$(($(now_ms) + timeout * 1000)) pods most_pods=0 socks most_socks=0 first t0
    first="$(plugin_pod_name)"
    t0="$(now_ms)"
    k -n kube-system rollout restart ds/gpu-device-plugin >/dev/null
    until rolled_from "$first" || (($(now_ms) > deadline)); do
        pods="$(plugin_pods | jq '.items | length')"
        socks="$(registration_sockets)"
        ((pods > most_pods)) && most_pods="$pods"
        ((socks > most_socks)) && most_socks="$socks"
    done
    if ((most_pods == 2 && most_socks == 2)); then
        pass "rolling update: two plugin pods side by side, each with its POD_UID registration socket"
    else
        fail "rolling update: two plugin pods side by side (most pods seen $most_pods, registration sockets $most_socks)"
    fi
    if rolled_from "$first"; then pass "rolling update done: the old pod gone, the new one Ready ($(secs $(($(now_ms) - t0))))"; else fail "rolling update done within ${timeout} s"; fi
}
dra_kubelet_restart() {
    if restart_kubelet; then pass "kubelet restarted with claims prepared"; else fail "kubelet restarted"; fi
    check "node Ready after the kubelet's restart" node_ready
}

road_dra() {
    echo "== DRA road: manifests/overlays/dra + the e2e components"
    local t0 gpu_cel
    t0="$(now_ms)"
    deploy dra || { fail "kubectl apply -k (manifests/overlays/dra)"; return; }
    check "DaemonSet's pod Ready" plugin_ready || return
    check --since "$t0" "ResourceSlice accepted: 6 devices (4 GPUs, 2 MIG devices)" slice_device_count_is 6 || return

    # Made the moment the slice is there: the slice goes out only once the kubelet has registered the driver.
    gpu_cel="device.attributes['gpu.nvidia.com'].type == 'gpu' && device.attributes['gpu.nvidia.com'].productName == 'NVIDIA H100 80GB HBM3' && device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0"
    claim_template e2e-h100 gpu.nvidia.com "$gpu_cel"
    t0="$(now_ms)"
    claim_pod e2e-dra-1 e2e-h100
    check --since "$t0" "ResourceClaimTemplate with a CEL selector (type, productName, capacity memory): pod Running" \
        container_running e2e-dra-1 || return
    if pod_events_have e2e-dra-1 "is not registered"; then
        fail "no 'DRA driver is not registered' for a pod bound as soon as the slice was there"
    else
        pass "no 'DRA driver is not registered' for a pod bound as soon as the slice was there"
    fi
    local claim dev bad uid
    claim="$(pod_claim e2e-dra-1)"
    dev="$(claim_devices "$claim")"
    bad="$(device_uuid "$dev")"
    uid="$(claim_uid "$claim")"
    if [[ "$bad" == GPU-* ]]; then pass "claim $claim allocated $dev ($bad)"; else fail "claim $claim allocated a GPU (got '$dev')"; return; fi
    check "prepared: the claim in the plugin's record" record_has "$uid"
    check "the pod's status shows the GPU Healthy" dra_health_is e2e-dra-1 Healthy

    echo "== XID 79 on $bad ($dev)"
    t0="$(now_ms)"
    fault "xid $bad 79"
    check --since "$t0" "pod status: health Unhealthy" dra_health_is e2e-dra-1 Unhealthy
    check --since "$t0" "pod status: message names XID 79" dra_message_has e2e-dra-1 "XID 79"
    check --since "$t0" "slice: $dev tainted gpu.nvidia.com/xid=79:NoSchedule" device_tainted "$dev" "gpu.nvidia.com/xid=79:NoSchedule"

    echo "== the pod deleted: unprepare"
    t0="$(now_ms)"
    k delete pod e2e-dra-1 --grace-period=1 --wait=true --timeout=60s >/dev/null
    check --since "$t0" "unprepared on the pod's deletion: the claim gone from the plugin's record" record_lacks "$uid"
    check --since "$t0" "the template's claim deleted" claim_gone "$claim"

    echo "== new claims beside the tainted GPU"
    claim_template e2e-three gpu.nvidia.com "device.attributes['gpu.nvidia.com'].type == 'gpu'" 3
    claim_template e2e-that-one gpu.nvidia.com "device.attributes['gpu.nvidia.com'].uuid == '$bad'"
    claim_pod e2e-dra-3 e2e-three
    claim_pod e2e-dra-2 e2e-that-one
    check "a claim for 3 GPUs gets the 3 untainted ones: pod Running" container_running e2e-dra-3
    local three
    three="$(claim_devices "$(pod_claim e2e-dra-3)")"
    if [[ ",$three," != *",$dev,"* && "$three" == *,*,* ]]; then pass "the 3 GPUs are $three, not $dev"; else fail "the 3 GPUs leave out $dev (got '$three')"; fi
    check "a claim for the tainted GPU only: not scheduled (FailedScheduling)" pod_events_have e2e-dra-2 "FailedScheduling"
    if pod_phase_is e2e-dra-2 Pending; then pass "the pod asking for the tainted GPU is Pending"; else fail "the pod asking for the tainted GPU is Pending"; fi
    k delete pod e2e-dra-3 --grace-period=1 --wait=true --timeout=60s >/dev/null

    echo "== recovery: the driver's recovery action 1 -> 0"
    t0="$(now_ms)"
    fault "action $bad 1"
    fault "action $bad 0"
    check --since "$t0" "slice: $dev untainted" device_untainted "$dev"
    check --since "$t0" "the claim for that GPU scheduled once it recovered: pod Running" container_running e2e-dra-2
    check --since "$t0" "its pod's status shows the GPU Healthy" dra_health_is e2e-dra-2 Healthy

    echo "== MIG through DRA"
    claim_template e2e-mig mig.nvidia.com "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"
    t0="$(now_ms)"
    claim_pod e2e-dra-mig e2e-mig
    check --since "$t0" "a claim of DeviceClass mig.nvidia.com (profile 1g.10gb): pod Running" container_running e2e-dra-mig
    local mig
    mig="$(claim_devices "$(pod_claim e2e-dra-mig)")"
    if [[ "$mig" == *-mig-1g10gb-* ]]; then pass "allocated MIG device $mig"; else fail "allocated a 1g.10gb MIG device (got '$mig')"; fi
    check "its pod's status shows the MIG device Healthy" dra_health_is e2e-dra-mig Healthy

    echo "== rolling update of the DaemonSet with claims prepared"
    # docs/dra.md: the pods' GPUs show their health again within a second of the old pod's stop; the kubelet
    # writes a pod's status at most about once a second, and the samples are 0.2 s apart plus a request.
    health_kept_through "rolling update" e2e-dra-2 2500 dra_rollout
    echo "== the kubelet restarted with claims prepared"
    health_kept_through "kubelet restart" e2e-dra-2 2500 dra_kubelet_restart
    check "the claims still prepared after both" record_has "$(claim_uid "$(pod_claim e2e-dra-2)")"
    check "the pods still Running" container_running e2e-dra-2

    $measure && measure_road dra e2e-dra-2 "$bad"

    echo "== a claim asking for MPS"
    k apply -f - >/dev/null <<EOF
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: e2e-mps
  namespace: default
  labels: {app.kubernetes.io/created-by: gpu-device-plugin-e2e}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.nvidia.com
    config:
      - requests: ["gpu"]
        opaque:
          driver: gpu.nvidia.com
          parameters:
            apiVersion: resource.nvidia.com/v1beta1
            kind: GpuConfig
            sharing:
              strategy: MPS
EOF
    new_pod e2e-dra-mps <<EOF
  restartPolicy: Always
  resourceClaims:
    - name: gpu
      resourceClaimName: e2e-mps
  containers:
    - name: main
      image: $POD_IMAGE
      imagePullPolicy: IfNotPresent
      command: ["sh", "-c", "while true; do sleep 1; done"]
      resources: {claims: [{name: gpu}]}
EOF
    check "the MPS claim refused: the message in the pod's events" pod_events_have e2e-dra-mps "asks for MPS"
    if container_running e2e-dra-mps; then fail "the pod with the MPS claim does not start"; else pass "the pod with the MPS claim does not start"; fi

    k delete pods -l "$CREATED_BY" --grace-period=1 --wait=true --timeout=60s >/dev/null 2>&1
    undeploy
}

# ---------------------------------------------------------------------------------------------------------

echo "== provider $provider"
provider_up || { fail "provider $provider up"; exit 1; }
echo "node $NODE, kubeconfig $KUBECONFIG"
node_sh "test -d $NODE_DIR" && node_dir_existed=yes || node_dir_existed=no
node_sh "test -d $STATE_DIR" && state_dir_existed=yes || state_dir_existed=no
node_sh "mkdir -p $NODE_DIR/pod && touch $NODE_DIR/faults && rm -f $NODE_DIR/pod/exit"
others="$(node_sh "ls /var/lib/kubelet/device-plugins" 2>/dev/null | grep '\.sock$' | grep -v '^kubelet\.sock$' | tr '\n' ' ')"
[[ -n "$others" ]] && echo "note: other device plugin sockets on the node before the run: $others"
echo "== image $IMAGE_REF"
if build_image; then pass "image built from the release build and loaded"; else fail "image built and loaded"; exit 1; fi
k label node "$NODE" nvidia.com/gpu.present=true --overwrite >/dev/null

[[ "$road" == dra ]] || road_dp
[[ "$road" == dp ]] || road_dra

echo "$passed passed, $failed failed"
((failed == 0))
