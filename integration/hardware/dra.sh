#!/usr/bin/env bash
# On a machine with a real NVIDIA GPU: the plugin serving it through DRA on the real NVML, against the fake
# kubelet's DRA side and a fake API server (fake-kubelet --dra-node), then one real XID 31 (xid31.py, CuPy).
# Prints what was published (the ResourceSlice's attributes from the driver), the health the kubelet
# knows before and after the fault, the status table, and nvidia-smi's own view to compare with.
#
# Usage: integration/hardware/dra.sh DIR   (DIR holds release builds of gpu-device-plugin and fake-kubelet)
set -euo pipefail
bin="$(cd "${1:?usage: dra.sh DIR}" && pwd)"
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
mkdir -p "$work/device-plugins"
cleanup() {
    kill "${plugin:-}" "${kubelet:-}" 2>/dev/null || true
}
trap cleanup EXIT

# Waits up to $2 tenths of a second for file $1 to hold a line matching $3.
wait_for() {
    for _ in $(seq "$2"); do
        grep -qE "$3" "$1" 2>/dev/null && return 0
        sleep 0.1
    done
    echo "dra.sh: timed out waiting for '$3' in $1" >&2
    return 1
}

"$bin/fake-kubelet" --dir "$work" --dra-node gpu-node >"$work/kubelet.out" 2>&1 &
kubelet=$!
wait_for "$work/kubelet.out" 100 '^api '
"$bin/gpu-device-plugin" --dra all --kubeconfig "$work/kubeconfig" --node-name gpu-node \
    --kubelet-registrar-directory-path "$work/plugins_registry" \
    --kubelet-plugins-directory-path "$work/plugins" \
    --kubelet-dir "$work/device-plugins" --state-dir "$work/state" \
    --http-addr 127.0.0.1:9412 >"$work/plugin.log" 2>&1 &
plugin=$!
wait_for "$work/kubelet.out" 300 '^health gpu-0 Healthy'
echo "== published and known before the fault"
cat "$work/kubelet.out"

echo "== one real XID 31 on GPU 0"
python3 "$here/xid31.py" || true
wait_for "$work/kubelet.out" 300 '^health gpu-0 .*XID 31'
wait_for "$work/kubelet.out" 100 'taints=.*gpu.nvidia.com/xid'
echo "== after the fault"
grep -E '^(health|slice) gpu-0' "$work/kubelet.out" | tail -2
echo "== gpu-device-plugin status"
"$bin/gpu-device-plugin" status --addr 127.0.0.1:9412 || true
echo "== nvidia-smi, to compare"
nvidia-smi --query-gpu=name,pci.bus_id,driver_version,memory.total,compute_cap --format=csv || true
nvidia-smi -q | grep -E 'Minor Number|CUDA Version|Product Brand|Product Architecture' || true
echo "== plugin warnings"
grep -E 'WARN|ERROR' "$work/plugin.log" || echo "none"
