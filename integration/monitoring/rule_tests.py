"""The alert rules under `promtool test rules`, over series taken from the plugin's own /metrics.

The plugin runs on the fake NVML (node.py) and goes through the faults the alerts are about, one at a time:
an XID 43 (no effect) and an XID 79, and their recovery after the quiet period, a GPU lost and restored, a GPU fenced and released, the
kubelet gone and back. After each step the test scrapes /metrics once the change shows there: each scrape is a
frame, every series in it exactly as the plugin wrote it. The promtool tests below are timelines of frames
("healthy for 5 minutes, then the XID frame for 10, then recovered") with the `instance` and `job` labels a
scrape adds, and each alert is expected to fire, with the summary an on-call person reads, and to resolve.

Two timelines need more than one node at once or a slower plugin than a test run gives:
- the fault burst puts the same real frames on four nodes, three of them faulting minutes apart;
- the publish latency takes the real run's histogram series (names, labels, buckets) and adds, for twenty
  minutes, observations in its 51.2 ms bucket: every real fault takes well under a millisecond.

Usage: python3 rule_tests.py [PROMTOOL]   (default: promtool on PATH). Exit status 0 when every test passed.
"""

import json
import os
import subprocess
import sys
import tempfile

import node
from node import Failure, gpu, parse, value

RULES = os.path.join(node.ROOT, "manifests", "components", "monitoring", "gpu-device-plugin.rules.yaml")
HEALTHY = "gpu_device_plugin_device_healthy"
CONDITION = "gpu_device_plugin_device_condition"
REGISTERED = "gpu_device_plugin_kubelet_registered"
BUCKET = "gpu_device_plugin_event_to_published_seconds_bucket"
JOB = "gpu-device-plugin"


def all_healthy(samples):
    values = [v for n, _, v in samples if n == HEALTHY]
    return len(values) == 4 and all(v == 1 for v in values)


def capture():
    """The frames: name -> the scrape's samples."""
    frames = {}
    config = "health:\n  quietPeriod: 3s\n  probeInterval: 1s\n"
    with node.Node(config) as n:
        frames["healthy"] = parse(n.scrape_when("four Healthy GPUs", all_healthy))

        # XID 43 first, which the policy records without effect: the summary must name only xid-79.
        n.inject("xid %s 43" % gpu(1), "xid %s 79" % gpu(1))
        frames["xid"] = parse(n.scrape_when(
            "GPU 1 Unhealthy with xid-79, and xid-43 without effect",
            lambda s: value(s, HEALTHY, index=1) == 0
            and value(s, CONDITION, index=1, kind="xid", value=79, effect="Unhealthy") == 1
            and value(s, CONDITION, index=1, kind="xid", value=43, effect="None") == 1))
        n.scrape_when("GPU 1 recovered after the quiet period", all_healthy)

        n.inject("lost %s" % gpu(2))
        frames["lost"] = parse(n.scrape_when(
            "GPU 2 lost", lambda s: value(s, CONDITION, index=2, kind="gpu-lost") == 1))
        n.inject("restore %s" % gpu(2))
        n.scrape_when("GPU 2 recovered once restored", all_healthy)

        n.command("fence", gpu(3), "--reason", "burn-in failed")
        frames["fenced"] = parse(n.scrape_when(
            "GPU 3 fenced", lambda s: value(s, CONDITION, index=3, kind="fenced") == 1))
        n.command("release", gpu(3), "--reason", "repaired")
        frames["recovered"] = parse(n.scrape_when("GPU 3 released", all_healthy))

        n.stop_kubelet()
        frames["unregistered"] = parse(n.scrape_when(
            "the kubelet gone", lambda s: value(s, REGISTERED) == 0))
        n.start_kubelet()
        n.registrations = 0
        n.wait_registered()
        frames["reregistered"] = parse(n.scrape_when(
            "registered again", lambda s: value(s, REGISTERED) == 1))
    return frames


def series_key(name, labels):
    return name + "{" + ",".join('%s="%s"' % (k, v.replace("\\", "\\\\").replace('"', '\\"'))
                                 for k, v in sorted(labels.items())) + "}"


def number(v):
    return repr(int(v)) if v == int(v) else repr(v)


def series(timeline, instance="node-a"):
    """promtool input series for `timeline`: [(samples, minutes)], one sample a minute, a series missing from
    a frame as `_` (absent, as in a scrape that lacks it)."""
    keys = {}
    for samples, _ in timeline:
        for name, labels, _v in samples:
            labels = dict(labels, instance=instance, job=JOB)
            keys.setdefault(series_key(name, labels), (name, labels))
    out = []
    for key, (name, labels) in keys.items():
        runs = []
        for samples, minutes in timeline:
            found = None
            for n, l, v in samples:
                if n == name and dict(l, instance=instance, job=JOB) == labels:
                    found = v
            runs.append((found, minutes))
        parts = []
        before = None
        for v, minutes in runs:
            if v is not None:
                parts.append("%sx%d" % (number(v), minutes - 1) if minutes > 1 else number(v))
            elif before is not None:
                # Gone from a scrape: Prometheus marks the series stale at once (no 5-minute look-back).
                parts.append("stale" + (" _x%d" % (minutes - 1) if minutes > 1 else ""))
            else:
                # promtool's `_xN` is N missing samples (where `vxN` is N + 1 values).
                parts.append("_x%d" % minutes)
            before = v
        out.append({"series": key, "values": " ".join(parts)})
    return out


def annotations(alert):
    """The description and runbook link of `alert` as the rules file has them (fixed text; the summary is what
    each test spells out)."""
    import re
    with open(RULES) as f:
        text = f.read()
    block = text.split("- alert: %s\n" % alert, 1)[1].split("- alert:", 1)[0]
    description = re.search(r"description: '((?:[^']|'')*)'", block).group(1).replace("''", "'")
    runbook = re.search(r"runbook_url: (\S+)", block).group(1)
    return description, runbook


def alert(name, severity, summary, **labels):
    description, runbook = annotations(name)
    # An empty label is no label to Prometheus: `value=""` of a condition without a value is not on the alert.
    labels = {k: v for k, v in labels.items() if v != ""}
    return {"exp_labels": dict(labels, severity=severity),
            "exp_annotations": {"summary": summary, "description": description, "runbook_url": runbook}}


def device(index):
    return {"instance": "node-a", "job": JOB, "resource": "nvidia.com/gpu", "device": gpu(index),
            "index": str(index)}


def slow(frame, minutes_flat, minutes_slow, minutes_after, per_minute=6, le_slow=0.0512):
    """The latency timeline: `frame`'s histogram flat, then `per_minute` observations a minute in the bucket
    `le_slow` (and every bucket above it, as a cumulative histogram counts), then flat again."""
    out = []
    for name, labels, v in frame:
        if not name.startswith("gpu_device_plugin_event_to_published_seconds"):
            continue
        key = series_key(name, dict(labels, instance="node-a", job=JOB))
        if name == BUCKET:
            le = float(labels["le"])
            step = per_minute if le >= le_slow else 0
        elif name.endswith("_count"):
            step = per_minute
        else:
            step = round(per_minute * 0.05, 6)
        top = v + step * minutes_slow
        values = "%sx%d %s+%sx%d %sx%d" % (number(v), minutes_flat - 1, number(v + step), number(step),
                                          minutes_slow - 1, number(top), minutes_after - 1)
        out.append({"series": key, "values": values})
    if not any(s["series"].startswith(BUCKET) for s in out):
        raise Failure("the scrape has no %s series" % BUCKET)
    return out


def tests(f):
    tests = []
    # A GPU Unhealthy from an XID: pending for its minute, firing with the engine's reason, gone on recovery.
    tests.append({
        "name": "GPUUnhealthy: XID 79 on GPU 1, then recovery",
        "interval": "1m",
        "input_series": series([(f["healthy"], 5), (f["xid"], 10), (f["recovered"], 10)]),
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "GPUUnhealthy", "exp_alerts": []},
            {"eval_time": "7m", "alertname": "GPUUnhealthy", "exp_alerts": [alert(
                "GPUUnhealthy", "warning",
                "GPU 1 (%s) on node-a is Unhealthy: xid-79" % gpu(1), **device(1))]},
            {"eval_time": "16m", "alertname": "GPUUnhealthy", "exp_alerts": []},
        ],
    })
    # A fenced GPU is Unhealthy with `fenced` as the reason; after a day it is an alert of its own.
    tests.append({
        "name": "GPUFencedForADay: GPU 3 fenced for 25 hours, then released",
        "interval": "1m",
        "input_series": series([(f["healthy"], 60), (f["fenced"], 25 * 60), (f["recovered"], 60)]),
        "alert_rule_test": [
            {"eval_time": "70m", "alertname": "GPUUnhealthy", "exp_alerts": [alert(
                "GPUUnhealthy", "warning",
                "GPU 3 (%s) on node-a is Unhealthy: fenced" % gpu(3), **device(3))]},
            {"eval_time": "24h59m", "alertname": "GPUFencedForADay", "exp_alerts": []},
            {"eval_time": "25h1m", "alertname": "GPUFencedForADay", "exp_alerts": [alert(
                "GPUFencedForADay", "warning",
                "GPU 3 (%s) on node-a has been fenced for more than a day" % gpu(3),
                kind="fenced", value="", effect="Unhealthy", **device(3))]},
            {"eval_time": "26h1m", "alertname": "GPUFencedForADay", "exp_alerts": []},
        ],
    })
    tests.append({
        "name": "GPULost: GPU 2 lost, then restored",
        "interval": "1m",
        "input_series": series([(f["healthy"], 5), (f["lost"], 10), (f["recovered"], 10)]),
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "GPULost", "exp_alerts": []},
            {"eval_time": "7m", "alertname": "GPULost", "exp_alerts": [alert(
                "GPULost", "critical",
                "GPU 2 (%s) on node-a is lost: it no longer answers the driver" % gpu(2),
                kind="gpu-lost", value="", effect="Unhealthy", **device(2))]},
            {"eval_time": "7m", "alertname": "GPUUnhealthy", "exp_alerts": [alert(
                "GPUUnhealthy", "warning",
                "GPU 2 (%s) on node-a is Unhealthy: gpu-lost" % gpu(2), **device(2))]},
            {"eval_time": "16m", "alertname": "GPULost", "exp_alerts": []},
        ],
    })
    tests.append({
        "name": "GPUPluginNotRegistered: the kubelet gone for 10 minutes, then back",
        "interval": "1m",
        "input_series": series([(f["recovered"], 5), (f["unregistered"], 10), (f["reregistered"], 10)]),
        "alert_rule_test": [
            {"eval_time": "9m", "alertname": "GPUPluginNotRegistered", "exp_alerts": []},
            {"eval_time": "11m", "alertname": "GPUPluginNotRegistered", "exp_alerts": [alert(
                "GPUPluginNotRegistered", "critical",
                "gpu-device-plugin on node-a has not been registered with the kubelet for 5 minutes",
                instance="node-a", job=JOB)]},
            {"eval_time": "16m", "alertname": "GPUPluginNotRegistered", "exp_alerts": []},
        ],
    })
    # The plugin cannot be scraped: its target's `up` is 0 and none of its own series come (a pod crash-looping
    # before it serves, or a /metrics answering 503). Every other alert reads the plugin's series, so this one
    # must fire on `up` alone; and not while the scrapes succeed.
    up, down = [("up", {}, 1)], [("up", {}, 0)]
    tests.append({
        "name": "GPUPluginDown: up 0 for 35 minutes with no plugin series",
        "interval": "1m",
        "input_series": series([(f["healthy"] + up, 5), (down, 35)]),
        "alert_rule_test": [
            {"eval_time": "9m", "alertname": "GPUPluginDown", "exp_alerts": []},
            {"eval_time": "16m", "alertname": "GPUPluginDown", "exp_alerts": [alert(
                "GPUPluginDown", "critical",
                "gpu-device-plugin on node-a could not be scraped for most of the last 10 minutes",
                instance="node-a", job=JOB)]},
            {"eval_time": "39m", "alertname": "GPUPluginDown", "exp_alerts": [alert(
                "GPUPluginDown", "critical",
                "gpu-device-plugin on node-a could not be scraped for most of the last 10 minutes",
                instance="node-a", job=JOB)]},
        ],
    })
    tests.append({
        "name": "GPUPluginDown: scraped for 40 minutes, nothing fires",
        "interval": "1m",
        "input_series": series([(f["healthy"] + up, 40)]),
        "alert_rule_test": [
            {"eval_time": "%dm" % m, "alertname": "GPUPluginDown", "exp_alerts": []} for m in (5, 16, 39)
        ],
    })
    tests.append({
        "name": "GPUNodeCapacityReduced: GPU 1 out for 40 minutes",
        "interval": "1m",
        "input_series": series([(f["healthy"], 5), (f["xid"], 40), (f["recovered"], 10)]),
        "alert_rule_test": [
            {"eval_time": "34m", "alertname": "GPUNodeCapacityReduced", "exp_alerts": []},
            {"eval_time": "36m", "alertname": "GPUNodeCapacityReduced", "exp_alerts": [alert(
                "GPUNodeCapacityReduced", "warning",
                "node-a has 3 of 4 nvidia.com/gpu allocatable for 30 minutes",
                instance="node-a", job=JOB, resource="nvidia.com/gpu")]},
            {"eval_time": "46m", "alertname": "GPUNodeCapacityReduced", "exp_alerts": []},
        ],
    })
    # Three nodes' GPUs fault 2 minutes apart, a fourth node stays healthy: a burst, over once the faults
    # are older than its 15-minute window (the GPUs themselves stay Unhealthy: GPUUnhealthy covers them).
    burst = []
    for instance, start in (("node-a", 5), ("node-b", 7), ("node-c", 9)):
        burst += series([(f["healthy"], start), (f["xid"], 40 - start)], instance)
    burst += series([(f["healthy"], 40)], "node-d")
    tests.append({
        "name": "GPUFaultBurst: GPUs on three of four nodes Unhealthy within 4 minutes",
        "interval": "1m",
        "input_series": burst,
        "alert_rule_test": [
            {"eval_time": "8m", "alertname": "GPUFaultBurst", "exp_alerts": []},
            {"eval_time": "12m", "alertname": "GPUFaultBurst", "exp_alerts": [alert(
                "GPUFaultBurst", "critical",
                "GPUs on 3 nodes turned Unhealthy within 15 minutes: look for a common cause (a driver or "
                "firmware roll-out)")]},
            {"eval_time": "25m", "alertname": "GPUFaultBurst", "exp_alerts": []},
        ],
    })
    tests.append({
        "name": "GPUHealthPublishSlow: twenty minutes of faults published in about 50 ms",
        "interval": "1m",
        "input_series": slow(f["recovered"], 10, 20, 30),
        "alert_rule_test": [
            {"eval_time": "10m", "alertname": "GPUHealthPublishSlow", "exp_alerts": []},
            {"eval_time": "18m", "alertname": "GPUHealthPublishSlow", "exp_alerts": [alert(
                "GPUHealthPublishSlow", "warning",
                "gpu-device-plugin on node-a takes 50.94ms (p99) to hand a GPU fault to the kubelet",
                instance="node-a", job=JOB)]},
            {"eval_time": "45m", "alertname": "GPUHealthPublishSlow", "exp_alerts": []},
        ],
    })
    return tests


def run():
    promtool = sys.argv[1] if len(sys.argv) > 1 else "promtool"
    frames = capture()
    suite = {"rule_files": [RULES], "evaluation_interval": "1m", "tests": tests(frames)}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "gpu-device-plugin.rules.test.yaml")
        with open(path, "w") as f:
            # JSON is YAML: promtool reads it as written.
            json.dump(suite, f, indent=1)
        done = subprocess.run([promtool, "test", "rules", path], capture_output=True, text=True)
        print(done.stdout, end="")
        print(done.stderr, end="", file=sys.stderr)
        if done.returncode != 0:
            with open(path) as f:
                kept = f.read()
            raise Failure("promtool test rules failed:\n%s\nthe test file (%d bytes) began:\n%s"
                          % (done.stderr, len(kept), kept[:6000]))
    alerts = {t["alertname"] for test in suite["tests"] for t in test["alert_rule_test"] if t["exp_alerts"]}
    print("rule tests: %d alerts fired and resolved over series scraped from the plugin: %s"
          % (len(alerts), ", ".join(sorted(alerts))))


if __name__ == "__main__":
    node.main_guard(run)
