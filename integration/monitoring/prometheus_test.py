"""A real Prometheus scraping the running plugin with the alert rules loaded, black-box.

Debian's Prometheus listens on 127.0.0.1 only and scrapes the plugin (on the fake NVML, node.py) every second,
with the rules of manifests/components/monitoring/gpu-device-plugin.rules.yaml unchanged and evaluated every
second; `instance` is set to a node name, as the PodMonitor does. Then:

1. an XID 79 on GPU 1: GPUUnhealthy must turn pending, then fire no sooner than its `for:` after the fault
   was first scraped and within a bounded slack after it, with the summary naming the GPU and `xid-79`;
2. the GPU recovers by itself (a quiet period longer than the `for:`, then a probe): the alert must resolve;
3. every query of the Grafana dashboard must run on this Prometheus, and every metric name in it must be one
   the plugin exports: in a scrape of this node during the fault, or of a node serving its GPUs through DRA
   (the DRA registration, the Kubernetes API writes).

Every wait polls the Prometheus API (or the plugin) for the state it expects, within a bound.
Usage: python3 prometheus_test.py [PROMETHEUS]   (default: prometheus on PATH)
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import node
from node import Failure, gpu, parse, value

RULES = os.path.join(node.ROOT, "manifests", "components", "monitoring", "gpu-device-plugin.rules.yaml")
DASHBOARD = os.path.join(node.ROOT, "manifests", "components", "monitoring", "dashboard.json")
# Longer than GPUUnhealthy's `for:` (1 min), so that the alert fires before the GPU recovers.
QUIET_PERIOD_S = 90
# How late the alert may fire after its `for:` has passed: scrapes and evaluations are every second, so a few
# seconds; the rest is room for a slow, shared CI machine.
SLACK_S = 20


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rule_for_s(alert):
    with open(RULES) as f:
        block = f.read().split("- alert: %s\n" % alert, 1)[1].split("- alert:", 1)[0]
    amount, unit = re.search(r"for: (\d+)([smh])", block).groups()
    return int(amount) * {"s": 1, "m": 60, "h": 3600}[unit]


class Prometheus:
    def __init__(self, binary, target):
        self.dir = tempfile.mkdtemp(prefix="gdp-prometheus-")
        self.addr = "127.0.0.1:%d" % free_port()
        config = os.path.join(self.dir, "prometheus.yml")
        with open(config, "w") as f:
            f.write("""\
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
  - %s
scrape_configs:
  - job_name: gpu-device-plugin
    static_configs:
      - targets: ['%s']
    relabel_configs:
      - target_label: instance
        replacement: node-a
""" % (RULES, target))
        self.log = open(os.path.join(self.dir, "prometheus.log"), "w")
        self.process = subprocess.Popen(
            [binary, "--config.file", config, "--storage.tsdb.path", os.path.join(self.dir, "data"),
             "--web.listen-address", self.addr],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.wait("Prometheus ready", lambda: self.get("/-/ready") is not None)

    def get(self, path):
        try:
            with urllib.request.urlopen("http://%s%s" % (self.addr, path), timeout=5) as r:
                return r.read().decode()
        except (OSError, ValueError):
            return None

    def api(self, path, **params):
        body = self.get("/api/v1/%s?%s" % (path, urllib.parse.urlencode(params)))
        if body is None:
            raise Failure("Prometheus did not answer /api/v1/%s %s" % (path, params))
        answer = json.loads(body)
        if answer.get("status") != "success":
            raise Failure("Prometheus refused /api/v1/%s %s: %s" % (path, params, answer))
        return answer["data"]

    def query(self, expr):
        return self.api("query", query=expr)["result"]

    def alerts(self, name):
        return [a for a in self.api("alerts")["alerts"] if a["labels"].get("alertname") == name]

    def wait(self, what, check, timeout=node.WAIT_S):
        deadline = time.monotonic() + timeout
        while True:
            result = check()
            if result:
                return result
            if self.process.poll() is not None:
                raise Failure("Prometheus exited\n" + self.output())
            if time.monotonic() > deadline:
                raise Failure("%s: not within %d s\n%s" % (what, timeout, self.output()[-3000:]))
            time.sleep(0.2)  # the next poll of the API; bounded by the deadline above

    def output(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def close(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=node.WAIT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def dashboard_queries():
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append(variable["definition"])
    return queries


def as_query(expr):
    """A dashboard expression as Grafana sends it, its variables filled in."""
    for variable, value_ in (("$__rate_interval", "1m"), ("$__range", "5m"), ("$node", ".*")):
        expr = expr.replace(variable, value_)
    return expr


def check_dashboard(prometheus, exported):
    names = set()
    for expr in dashboard_queries():
        used = set(re.findall(r"\bgpu_device_plugin_[a-z0-9_]+", expr))
        unknown = used - exported
        if unknown:
            raise Failure("the dashboard query %r uses %s, which the plugin does not export (it does: %s)"
                          % (expr, ", ".join(sorted(unknown)), ", ".join(sorted(exported))))
        if not used:
            raise Failure("the dashboard query %r reads none of the plugin's metrics" % expr)
        names |= used
        match = re.match(r"label_values\((\w+), (\w+)\)$", expr)
        if match:
            values = prometheus.api("label/%s/values" % match.group(2), **{"match[]": match.group(1)})
            if "node-a" not in values:
                raise Failure("the dashboard's node variable %r offers %s, not node-a" % (expr, values))
        else:
            prometheus.query(as_query(expr))
    return len(dashboard_queries()), len(names)


def exported_by_dra_node():
    with node.Node("", dra=True) as n:
        n.inject("xid %s 79" % gpu(0))
        text = n.scrape_when(
            "a DRA node's registration and API writes",
            lambda s: value(s, "gpu_device_plugin_dra_registered") == 1
            and value(s, "gpu_device_plugin_kubernetes_api_writes_total") is not None)
    return {name for name, _, _ in parse(text)}


def run():
    binary = sys.argv[1] if len(sys.argv) > 1 else "prometheus"
    for_s = rule_for_s("GPUUnhealthy")
    config = "health:\n  quietPeriod: %ds\n  probeInterval: 1s\n" % QUIET_PERIOD_S
    with node.Node(config) as n:
        prometheus = Prometheus(binary, n.addr)
        try:
            prometheus.wait("the plugin scraped", lambda: prometheus.query(
                'gpu_device_plugin_device_healthy{instance="node-a",index="1"} == 1'))
            if prometheus.alerts("GPUUnhealthy"):
                raise Failure("GPUUnhealthy before any fault: %s" % prometheus.alerts("GPUUnhealthy"))

            n.inject("xid %s 79" % gpu(1))
            fault = time.monotonic()
            text = n.scrape_when("GPU 1 Unhealthy", lambda s: value(
                s, "gpu_device_plugin_device_healthy", index=1) == 0)
            exported = {name for name, _, _ in parse(text)}
            prometheus.wait("GPU 1 Unhealthy in Prometheus", lambda: prometheus.query(
                'gpu_device_plugin_device_healthy{instance="node-a",index="1"} == 0'))
            seen = time.monotonic()
            pending = prometheus.wait("GPUUnhealthy pending", lambda: [
                a for a in prometheus.alerts("GPUUnhealthy") if a["state"] in ("pending", "firing")])
            pending_at = time.monotonic()
            if pending[0]["state"] == "firing":
                raise Failure("GPUUnhealthy fired at once, not after its for: of %d s" % for_s)

            exported |= exported_by_dra_node()
            queries, names = check_dashboard(prometheus, exported)

            firing = prometheus.wait("GPUUnhealthy firing", lambda: [
                a for a in prometheus.alerts("GPUUnhealthy") if a["state"] == "firing"],
                timeout=for_s + SLACK_S)
            fired = time.monotonic()
            alert = firing[0]
            summary = alert["annotations"]["summary"]
            want = "GPU 1 (%s) on node-a is Unhealthy: xid-79" % gpu(1)
            if summary != want or alert["labels"].get("severity") != "warning" or len(firing) != 1:
                raise Failure("GPUUnhealthy fired as %s; want one alert, severity warning, summary %r"
                              % (firing, want))
            if fired - fault < for_s:
                raise Failure("GPUUnhealthy fired %.1f s after the fault, before its for: of %d s"
                              % (fired - fault, for_s))

            prometheus.wait("GPU 1 recovered in Prometheus", lambda: prometheus.query(
                'gpu_device_plugin_device_healthy{instance="node-a",index="1"} == 1'),
                timeout=QUIET_PERIOD_S + SLACK_S)
            recovered = time.monotonic()
            prometheus.wait("GPUUnhealthy resolved", lambda: not prometheus.alerts("GPUUnhealthy"))
            resolved = time.monotonic()
        finally:
            prometheus.close()
    print("real Prometheus: GPUUnhealthy (for: %d s) pending %.1f s and firing %.1f s after the XID 79 was "
          "written (Unhealthy in Prometheus after %.1f s), with its summary %r; resolved %.1f s after the GPU "
          "recovered in Prometheus (%.1f s after the fault)"
          % (for_s, pending_at - fault, fired - fault, seen - fault, summary, resolved - recovered,
             resolved - fault))
    print("dashboard: %d queries (the panels' and the node variable's) ran on Prometheus; the %d metric names "
          "in them are all in the plugin's scrapes" % (queries, names))


if __name__ == "__main__":
    node.main_guard(run)
