#!/usr/bin/env python3
"""Fault -> the pod's status field, as an API watch sees it, on a real node.

usage: latency.py --pod NAME --uuid GPU-... --fault-file PATH [--road dp|dra] [--count N] [--settle S]
                  [--paced N] [--namespace NS]

Opens one watch on the pod (the API server and credentials of the current kubeconfig, from `kubectl config
view --raw`), then N times: waits until the GPU is Healthy in the pod's `allocatedResourcesStatus` and the pod's
status has not changed for --settle seconds (default 1.5: the kubelet writes a pod's status at most about
once a second), appends `xid <uuid> 79` to the fake NVML's fault file and times the watch event that shows it
Unhealthy; then recovers it (`action <uuid> 1`, `action <uuid> 0`). --paced N more faults are made right after
the Healthy status arrived, to show the kubelet's own pace. Prints each sample and p50/p99 in ms, and a JSON
line at the end. Every wait is bounded (60 s).
"""
import argparse
import base64
import json
import os
import queue
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import http.client

WAIT = 60.0


def kubeconfig():
    raw = subprocess.run(["kubectl", "config", "view", "--raw", "--minify", "-o", "json"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    cfg = json.loads(raw)
    cluster = cfg["clusters"][0]["cluster"]
    user = cfg["users"][0]["user"]
    tmp = tempfile.mkdtemp()

    def material(data_key, file_key, name):
        if user.get(data_key) or cluster.get(data_key):
            path = os.path.join(tmp, name)
            with open(path, "wb") as f:
                f.write(base64.b64decode(user.get(data_key) or cluster.get(data_key)))
            return path
        return user.get(file_key) or cluster.get(file_key)

    ctx = ssl.create_default_context(cafile=material("certificate-authority-data", "certificate-authority", "ca"))
    cert = material("client-certificate-data", "client-certificate", "crt")
    if cert:
        ctx.load_cert_chain(cert, material("client-key-data", "client-key", "key"))
    headers = {"Authorization": "Bearer " + user["token"]} if user.get("token") else {}
    return urllib.parse.urlparse(cluster["server"]), ctx, headers


def health_of(pod, road, uuid):
    for c in pod.get("status", {}).get("containerStatuses", []) or []:
        for r in c.get("allocatedResourcesStatus", []) or []:
            for res in r.get("resources", []) or []:
                if road == "dra" or res.get("resourceID") == uuid:
                    return res.get("health")
    return None


def watch(server, ctx, headers, ns, pod, road, uuid, events):
    """Puts (arrival time, health) for each event of the pod's watch on `events`; reconnects on an end."""
    while True:
        conn = http.client.HTTPSConnection(server.hostname, server.port or 443, context=ctx, timeout=300)
        q = urllib.parse.urlencode({"watch": "1", "fieldSelector": f"metadata.name={pod}",
                                    "allowWatchBookmarks": "false", "timeoutSeconds": "3600"})
        conn.request("GET", f"/api/v1/namespaces/{ns}/pods?{q}", headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            print(f"watch: HTTP {resp.status}: {resp.read()[:200]!r}", file=sys.stderr)
            time.sleep(1)
            continue
        while True:
            line = resp.readline()
            if not line:
                break
            now = time.monotonic()
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            events.put((now, health_of(ev.get("object", {}), road, uuid)))


def pct(samples, p):
    s = sorted(samples)
    return s[min(len(s) - 1, max(0, int(round(p / 100 * len(s) + 0.5)) - 1))]


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--pod", required=True)
    a.add_argument("--namespace", default="default")
    a.add_argument("--uuid", required=True)
    a.add_argument("--fault-file", required=True)
    a.add_argument("--road", choices=["dp", "dra"], default="dp")
    a.add_argument("--count", type=int, default=20)
    a.add_argument("--paced", type=int, default=0)
    a.add_argument("--settle", type=float, default=1.5)
    args = a.parse_args()

    server, ctx, headers = kubeconfig()
    events = queue.Queue()
    threading.Thread(target=watch, args=(server, ctx, headers, args.namespace, args.pod, args.road, args.uuid,
                                         events), daemon=True).start()
    state = {"health": None, "changed": time.monotonic()}

    def next_event(deadline):
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            at, health = events.get(timeout=left)
        except queue.Empty:
            return None
        state["health"], state["changed"] = health, at
        return at, health

    def wait_health(want, deadline):
        while state["health"] != want:
            if next_event(deadline) is None:
                raise SystemExit(f"latency.py: {args.pod} not {want} within {WAIT} s")
        return state["changed"]

    def append(*lines):
        with open(args.fault_file, "a") as f:
            f.write("".join(line + "\n" for line in lines))
            f.flush()

    def one(settle):
        wait_health("Healthy", time.monotonic() + WAIT)
        # quiet for `settle` seconds: no status event meanwhile
        while True:
            quiet_until = state["changed"] + settle
            if time.monotonic() >= quiet_until:
                break
            next_event(quiet_until)
        since = time.monotonic() - state["changed"]
        t0 = time.monotonic()
        append(f"xid {args.uuid} 79")
        seen = wait_health("Unhealthy", t0 + WAIT)
        append(f"action {args.uuid} 1", f"action {args.uuid} 0")
        return (seen - t0) * 1000, since

    samples, paced = [], []
    for i in range(args.count):
        ms, since = one(args.settle)
        samples.append(ms)
        print(f"fault {i + 1}: {ms:.1f} ms ({since:.2f} s after the pod's last status update)")
    for i in range(args.paced):
        ms, since = one(0.0)
        paced.append(ms)
        print(f"paced fault {i + 1}: {ms:.1f} ms ({since:.2f} s after the pod's last status update)")
    wait_health("Healthy", time.monotonic() + WAIT)
    out = {"road": args.road, "count": len(samples), "p50_ms": round(pct(samples, 50), 1),
           "p99_ms": round(pct(samples, 99), 1), "max_ms": round(max(samples), 1), "min_ms": round(min(samples), 1)}
    if paced:
        out.update({"paced_count": len(paced), "paced_p50_ms": round(pct(paced, 50), 1),
                    "paced_max_ms": round(max(paced), 1)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
