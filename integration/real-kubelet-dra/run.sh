#!/usr/bin/env bash
# Runs the plugin binary's DRA mode through the real kubelet 1.32 DRA code, in a private mount namespace (root
# needed) with a tmpfs on /var/lib/kubelet.
# usage: [AUTHORITY_SHIM=false|dra|all|true] run.sh PLUGIN_BINARY FAKE_KUBELET_BINARY [KLOG_VERBOSITY]
# AUTHORITY_SHIM: false (the default): the kubelet dials both of the plugin's sockets directly; dra: only the DRA
# socket is relayed with :authority localhost (the 1.32 DRA client dials it by path; see README.md); all or
# true: both sockets are relayed.
# Prints PASS/FAIL lines; the kubelet's log (klog) and the plugin's log stay in the work directory it names.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
h="$here/.build/draharness"
[ -x "$h" ] || { echo "real-kubelet-dra: harness not built (integration/real-kubelet-dra/build.sh)"; exit 1; }
shim=${AUTHORITY_SHIM:-false}
case $shim in
  false | dra | all | true) ;;
  *) echo "real-kubelet-dra: AUTHORITY_SHIM=$shim: want false, dra, all or true"; exit 1 ;;
esac
bin=$(readlink -f "$1"); fk=$(readlink -f "$2"); v=${3:-4}; w=$(mktemp -d)
echo "work directory: $w (kubelet.log, plugin.log)"
export HARNESS_LOG="$w/plugin.log" H="$h" BIN="$bin" FK="$fk" W="$w" V="$v" SHIM="$shim"
# shellcheck disable=SC2016 # expanded by the inner shell
unshare -m bash -c 'set -e; mkdir -p /var/lib/kubelet && mount -t tmpfs tmpfs /var/lib/kubelet &&
  mkdir -p /var/lib/kubelet/device-plugins /var/lib/kubelet/plugins_registry /var/lib/kubelet/plugins &&
  "$H" -plugin "$BIN" -fake-kubelet "$FK" -work "$W" -v "$V" -logtostderr=true -authority-shim="$SHIM" 2>"$W/kubelet.log"'
