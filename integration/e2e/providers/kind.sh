# shellcheck shell=bash disable=SC2034,SC2154
# (SC2034, SC2154: the variables this file sets for run.sh, and run.sh's it reads: work, keep, root)
# Provider `kind`: a kind cluster of a control plane and a worker, created for the run and deleted after it
# (unless --keep). Needs docker (or podman as docker), kind and kubectl. Sourced by run.sh.
#
# Environment: KIND_NODE_IMAGE (default kindest/node:v1.34.0: a Kubernetes with DRA's resource.k8s.io/v1 and the
# ResourceHealthStatus feature gate), CLUSTER (the cluster's name, default gpu-device-plugin-e2e).

CLUSTER="${CLUSTER:-gpu-device-plugin-e2e}"
KIND_NODE_IMAGE="${KIND_NODE_IMAGE:-kindest/node:v1.34.0}"

provider_usage() {
    echo "  kind    a kind cluster made for the run (KIND_NODE_IMAGE, CLUSTER); needs docker and kind"
}

provider_check() {
    local missing=()
    for tool in docker kind kubectl; do
        command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
    done
    if command -v docker >/dev/null 2>&1 && ! docker info >/dev/null 2>&1; then
        missing+=("a running container engine (docker info fails)")
    fi
    if ((${#missing[@]} > 0)); then
        printf 'missing: %s\n' "${missing[@]}" >&2
        return 1
    fi
}

provider_up() {
    local config="$work/kind.yaml"
    cat >"$config" <<'YAML'
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
featureGates:
  ResourceHealthStatus: true
  DRADeviceTaints: true
nodes:
  - role: control-plane
  - role: worker
YAML
    kind create cluster --name "$CLUSTER" --image "$KIND_NODE_IMAGE" --config "$config" --wait 120s || return 1
    kind_created=true
    export KUBECONFIG="$work/kubeconfig"
    kind get kubeconfig --name "$CLUSTER" >"$KUBECONFIG" || return 1
    NODE="$CLUSTER-worker"
    POD_IMAGE="busybox:1.37"
    LOOPBACK=false
}

provider_load_image() { # ARCHIVE
    kind load image-archive "$1" --name "$CLUSTER" --nodes "$NODE"
}

provider_unload_image() {
    docker exec "$NODE" ctr -n k8s.io images rm "$IMAGE_REF" >/dev/null 2>&1 || true
}

node_sh() {
    docker exec "$NODE" sh -c "$1"
}

restart_kubelet() {
    docker exec "$NODE" systemctl restart kubelet
}

provider_down() {
    if [[ "${kind_created:-false}" != true ]]; then
        return
    fi
    if $keep; then
        echo "cluster kept: kind delete cluster --name $CLUSTER"
    else
        kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
    fi
}
