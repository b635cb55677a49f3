# shellcheck shell=bash disable=SC2034,SC2154
# (SC2034, SC2154: the variables this file sets for run.sh, and run.sh's it reads: work, keep, root)
# Provider `local`: the single-node Kubernetes that ../shared/local-cluster/up.sh brought up on this machine
# (state in $LC, default /tmp/lc; node 127.0.0.1; containerd 1.6; loopback only). Sourced by run.sh.
#
# Environment: LC (the cluster's state directory), LOCAL_CLUSTER (its scripts, default ../shared/local-cluster
# beside this repository), NODE (default 127.0.0.1).

LC="${LC:-/tmp/lc}"
LOCAL_CLUSTER="${LOCAL_CLUSTER:-$(cd "$root/.." && pwd)/shared/local-cluster}"

provider_usage() {
    echo "  local   the cluster ../shared/local-cluster/up.sh started (state in \$LC, default /tmp/lc); run as root"
}

provider_check() {
    local missing=()
    [[ -f "$LC/etc/admin.kubeconfig" ]] || missing+=("$LC/etc/admin.kubeconfig (start the cluster: $LOCAL_CLUSTER/up.sh)")
    [[ -x "$LOCAL_CLUSTER/up.sh" ]] || missing+=("$LOCAL_CLUSTER/up.sh (set LOCAL_CLUSTER)")
    command -v ctr >/dev/null 2>&1 || missing+=("ctr (containerd)")
    [[ -f "$LC/run/kubelet.pid" ]] && kill -0 "$(cat "$LC/run/kubelet.pid")" 2>/dev/null ||
        missing+=("a running kubelet ($LC/run/kubelet.pid; $LOCAL_CLUSTER/up.sh starts it)")
    ((EUID == 0)) || missing+=("root (ctr, the node's directories)")
    if ((${#missing[@]} > 0)); then
        printf 'missing: %s\n' "${missing[@]}" >&2
        return 1
    fi
}

provider_up() {
    export KUBECONFIG="$LC/etc/admin.kubeconfig"
    # kubectl 1.36 from the cluster's build, when there
    export PATH="$LC/bin:$PATH"
    NODE="${NODE:-127.0.0.1}"
    POD_IMAGE="lc.local/busybox:1.35"
    LOOPBACK=true
}

provider_load_image() { # ARCHIVE
    ctr -n k8s.io images import "$1" >/dev/null
}

provider_unload_image() {
    ctr -n k8s.io images rm "$IMAGE_REF" >/dev/null 2>&1 || true
}

# Runs a shell command on the node, as root.
node_sh() {
    sh -c "$1"
}

# Stops the kubelet by its recorded PID and starts it again through up.sh (which starts only what is not
# running). Bounded: 20 s for the stop, up.sh's own waits for the start.
restart_kubelet() {
    local pid
    pid="$(cat "$LC/run/kubelet.pid")" || return 1
    kill -TERM "$pid" 2>/dev/null || return 1
    for ((i = 0; i < 40; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
    done
    kill -0 "$pid" 2>/dev/null && return 1
    LC="$LC" timeout 200 "$LOCAL_CLUSTER/up.sh" >>"$work/up.log" 2>&1
}

provider_down() {
    :
}
