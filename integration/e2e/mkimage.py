#!/usr/bin/env python3
"""Builds the plugin's image as an OCI archive from a release build, without docker or a registry.

usage: mkimage.py OUT.tar [--target DIR] [--name REF]

The image holds what the Dockerfile's image holds, at the same paths (integration/e2e/image.json, which
integration/tests/image.rs checks against the Dockerfile): the plugin binary, the fake NVML library, the
unprivileged user 65532 and the entrypoint. In place of the Dockerfile's distroless base (Debian 12's C library
and nothing else), it takes the shared libraries the two files need from this host, as `ldd` resolves them:
build on Debian 12 (glibc 2.36), as the Dockerfile's build stage does.

One layer, files owned by root with fixed times, so the same inputs give the same digest. Import the archive
with `ctr -n k8s.io images import OUT.tar`, or `kind load image-archive OUT.tar`.
"""
import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CREATED = "1970-01-01T00:00:00Z"
# The users and groups distroless's nonroot image has.
PASSWD = b"root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"
GROUP = b"root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n"


def fail(msg):
    print(f"mkimage.py: {msg}", file=sys.stderr)
    sys.exit(1)


def shared_libraries(path):
    """The absolute paths of the libraries `ldd` says `path` loads, the program interpreter included."""
    try:
        out = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        fail(f"cannot run ldd on {path}: {e}")
    if out.returncode != 0:
        fail(f"ldd {path} failed: {out.stderr.strip() or out.stdout.strip()}")
    libs = []
    for line in out.stdout.splitlines():
        if "not found" in line:
            fail(f"{path} needs a library this host lacks: {line.strip()}")
        m = re.search(r"=>\s+(/\S+)", line) or re.match(r"\s*(/\S+)\s+\(0x", line)
        if m:
            libs.append(m.group(1))
    return libs


def stripped(src, tmp):
    """A copy of `src` without symbols, as the Dockerfile's build makes it (CARGO_PROFILE_RELEASE_STRIP=symbols)."""
    out = os.path.join(tmp, os.path.basename(src))
    try:
        subprocess.run(["strip", "--strip-all", "-o", out, src], check=True, timeout=120, capture_output=True)
    except (OSError, subprocess.SubprocessError) as e:
        fail(f"cannot strip {src} (binutils' strip): {e}")
    return out


def layer_of(files, dirs):
    """A tar of `files` ([(path in image, source file, mode)]) and `dirs` ([(path, mode, uid)]), with parents."""
    buf = io.BytesIO()
    seen = set()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        def add_dir(path, mode=0o755, uid=0):
            name = path.strip("/")
            if not name or name in seen:
                return
            add_dir(os.path.dirname(name))
            seen.add(name)
            ti = tarfile.TarInfo(name)
            ti.type, ti.mode, ti.mtime, ti.uid, ti.gid = tarfile.DIRTYPE, mode, 0, uid, uid
            t.addfile(ti)

        for path, mode, uid in dirs:
            add_dir(path, mode, uid)
        for path, src, mode in sorted(files, key=lambda f: f[0]):
            name = path.strip("/")
            add_dir(os.path.dirname(name))
            ti = tarfile.TarInfo(name)
            ti.mode, ti.mtime = mode, 0
            if isinstance(src, bytes):
                ti.size = len(src)
                t.addfile(ti, io.BytesIO(src))
            else:
                with open(src, "rb") as f:
                    data = f.read()
                ti.size = len(data)
                t.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="the OCI archive to write")
    p.add_argument("--target", default=os.path.join(ROOT, "target", "release"),
                   help="where the release build is (default: target/release)")
    p.add_argument("--name", help="the image reference (default: image.json's)")
    args = p.parse_args()

    with open(os.path.join(HERE, "image.json")) as f:
        spec = json.load(f)
    name = args.name or spec["name"]
    files, libs = [], set()
    tmp = tempfile.mkdtemp()
    for entry in spec["files"]:
        src = os.path.join(args.target, entry["from"])
        if not os.path.isfile(src):
            fail(f"{src} is missing: build it first (cargo build --release -p gpu-device-plugin -p fake-nvml)")
        libs.update(shared_libraries(src))
        files.append((entry["path"], stripped(src, tmp), int(entry["mode"], 8)))
    for lib in sorted(libs):
        files.append((lib, os.path.realpath(lib), 0o755))
    files += [("/etc/passwd", PASSWD, 0o644), ("/etc/group", GROUP, 0o644)]
    uid = int(spec["user"].split(":")[0])
    dirs = [("/tmp", 0o1777, 0), ("/home/nonroot", 0o700, uid), ("/proc", 0o555, 0), ("/sys", 0o555, 0),
            ("/dev", 0o755, 0), ("/etc", 0o755, 0), ("/var/lib", 0o755, 0), ("/run", 0o755, 0)]
    layer = layer_of(files, dirs)
    layer_digest = hashlib.sha256(layer).hexdigest()

    config = json.dumps({
        "architecture": "amd64", "os": "linux", "created": CREATED,
        "config": {
            "User": spec["user"], "Entrypoint": spec["entrypoint"], "WorkingDir": "/home/nonroot",
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "Labels": {"org.opencontainers.image.title": "gpu-device-plugin"},
        },
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + layer_digest]},
        "history": [{"created": CREATED, "created_by": "integration/e2e/mkimage.py"}],
    }, separators=(",", ":"), sort_keys=True).encode()
    config_digest = hashlib.sha256(config).hexdigest()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": "sha256:" + config_digest, "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": "sha256:" + layer_digest, "size": len(layer)}],
    }, separators=(",", ":"), sort_keys=True).encode()
    manifest_digest = hashlib.sha256(manifest).hexdigest()
    index = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": "sha256:" + manifest_digest, "size": len(manifest),
            "annotations": {"io.containerd.image.name": name,
                            "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]},
            "platform": {"architecture": "amd64", "os": "linux"},
        }],
    }, separators=(",", ":"), sort_keys=True).encode()

    with tarfile.open(args.out, "w") as t:
        def add(member, data):
            ti = tarfile.TarInfo(member)
            ti.size, ti.mode, ti.mtime = len(data), 0o644, 0
            t.addfile(ti, io.BytesIO(data))

        add("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add("index.json", index)
        for digest, data in [(layer_digest, layer), (config_digest, config), (manifest_digest, manifest)]:
            add("blobs/sha256/" + digest, data)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.out}: {name} sha256:{manifest_digest} ({len(layer) // 1024} KiB layer)")


if __name__ == "__main__":
    main()
