"""The monitoring component (manifests/components/monitoring) checked as CI checks the other overlays:

- the base with the component, rendered by kustomize (given as a file), every object valid: the PodMonitor
  and the PrometheusRule against the prometheus-operator's CRD schemas (vendored in crds/, with where they
  come from), strictly (a field the schema does not name is an error, as it is for the other objects), and the
  rest (the dashboard's ConfigMap, the base) against the Kubernetes schemas with kubernetes-validate;
- the PodMonitor selects the DaemonSet's pods, in its namespace, on a port the container names;
- the PrometheusRule holds exactly the rules of gpu-device-plugin.rules.yaml (`--write` regenerates it);
- every alert has a severity, a summary, a description and a runbook_url whose anchor is a heading of
  docs/alerts.md; the dashboard is valid JSON with a query in every target.

Usage: python3 check_manifests.py RENDERED.yaml [KUBERNETES_VERSION...]   (needs PyYAML, jsonschema and
kubernetes-validate: .ci/run's tools environment)
       python3 check_manifests.py --write     (regenerates prometheusrule.yaml from the rules file)
"""

import copy
import json
import os
import re
import sys

import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
COMPONENT = os.path.join(ROOT, "manifests", "components", "monitoring")
RULES = os.path.join(COMPONENT, "gpu-device-plugin.rules.yaml")
PROMETHEUS_RULE = os.path.join(COMPONENT, "prometheusrule.yaml")
DASHBOARD = os.path.join(COMPONENT, "dashboard.json")
ALERTS_DOC = os.path.join(ROOT, "docs", "alerts.md")
CRDS = os.path.join(os.path.dirname(__file__), "crds")

HEADER = """\
# gpu-device-plugin's alerts for the prometheus-operator: the rules of gpu-device-plugin.rules.yaml (the plain
# rules file beside it, which is where to edit them), as a PrometheusRule. Generated:
# `python3 integration/monitoring/check_manifests.py --write`; CI checks the two agree.
# What each alert means and what to do: docs/alerts.md.
"""


class Failure(Exception):
    pass


def rules():
    with open(RULES) as f:
        return yaml.safe_load(f)


def prometheus_rule():
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "gpu-device-plugin", "namespace": "kube-system"},
        "spec": rules(),
    }


def write():
    with open(PROMETHEUS_RULE, "w") as f:
        f.write(HEADER)
        yaml.safe_dump(prometheus_rule(), f, sort_keys=False, width=120, allow_unicode=True)
    print("wrote %s" % os.path.relpath(PROMETHEUS_RULE, ROOT))


def strict(schema):
    """`schema` (an OpenAPI v3 schema of a CRD) with unknown fields refused wherever it lists the fields: the
    API server would prune them silently, which hides a typo in a manifest."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    return schema


def crd_schemas():
    schemas = {}
    for name in sorted(os.listdir(CRDS)):
        with open(os.path.join(CRDS, name)) as f:
            crd = yaml.safe_load(f)
        kind = crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            api = "%s/%s" % (crd["spec"]["group"], version["name"])
            schemas[(api, kind)] = strict(version["schema"]["openAPIV3Schema"])
    return schemas


def validate_custom(doc, schemas):
    import jsonschema
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in schemas:
        raise Failure("no CRD schema for %s %s" % key)
    errors = sorted(jsonschema.Draft7Validator(schemas[key]).iter_errors(doc), key=lambda e: list(e.path))
    if errors:
        raise Failure("%s/%s: %s" % (doc["kind"], doc["metadata"]["name"], "; ".join(
            "%s: %s" % ("/".join(map(str, e.path)) or "(top)", e.message) for e in errors)))


def slugs(path):
    """The anchors GitHub makes of a Markdown file's headings (as docs/check_links.py computes them)."""
    out, fence = set(), False
    with open(path) as f:
        for line in f:
            if line.lstrip().startswith("```"):
                fence = not fence
                continue
            m = None if fence else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m:
                text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).replace("`", "")
                out.add(re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-"))
    return out


def check_rules():
    group = rules()["groups"]
    anchors = slugs(ALERTS_DOC) if os.path.exists(ALERTS_DOC) else set()
    names = []
    for g in group:
        for rule in g["rules"]:
            name = rule.get("alert")
            names.append(name)
            if rule.get("labels", {}).get("severity") not in ("critical", "warning", "info"):
                raise Failure("%s: no severity critical, warning or info" % name)
            a = rule.get("annotations", {})
            for key in ("summary", "description", "runbook_url"):
                if not a.get(key):
                    raise Failure("%s: no %s" % (name, key))
            anchor = a["runbook_url"].partition("#")[2]
            if not a["runbook_url"].endswith("/docs/alerts.md#" + anchor) or anchor not in anchors:
                raise Failure("%s: runbook_url %s is not a section of docs/alerts.md" % (name, a["runbook_url"]))
    with open(PROMETHEUS_RULE) as f:
        generated = yaml.safe_load(f)
    if generated != prometheus_rule():
        raise Failure("prometheusrule.yaml does not hold the rules of gpu-device-plugin.rules.yaml: run "
                      "python3 integration/monitoring/check_manifests.py --write")
    return names


def check_dashboard():
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    queries = [t.get("expr") for p in dashboard["panels"] for t in p.get("targets", [])]
    if not queries or not all(queries):
        raise Failure("dashboard.json: a target without a query")
    return len(queries)


def check_rendered(path, versions):
    import kubernetes_validate
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    schemas = crd_schemas()
    by_kind = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            validate_custom(doc, schemas)
        else:
            for version in versions:
                try:
                    kubernetes_validate.validate(doc, version, strict=True)
                except kubernetes_validate.ValidationError as e:
                    raise Failure("%s/%s (Kubernetes %s): %s" % (doc["kind"], doc["metadata"]["name"], version,
                                                                  e.message))
    for kind in ("PodMonitor", "PrometheusRule", "DaemonSet", "ConfigMap"):
        if kind not in by_kind:
            raise Failure("the rendered component has no %s" % kind)
    monitor, daemonset = by_kind["PodMonitor"][0], by_kind["DaemonSet"][0]
    pod = daemonset["spec"]["template"]
    selector = monitor["spec"]["selector"].get("matchLabels", {})
    labels = pod["metadata"].get("labels", {})
    if not selector or any(labels.get(k) != v for k, v in selector.items()):
        raise Failure("the PodMonitor selects %s; the DaemonSet's pods are labelled %s" % (selector, labels))
    if monitor["metadata"].get("namespace") != daemonset["metadata"].get("namespace"):
        raise Failure("the PodMonitor is in namespace %s, the DaemonSet in %s" % (
            monitor["metadata"].get("namespace"), daemonset["metadata"].get("namespace")))
    ports = {p.get("name"): p for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        if endpoint.get("port") not in ports:
            raise Failure("the PodMonitor scrapes port %r; the container's ports are %s" % (
                endpoint.get("port"), sorted(ports)))
        if endpoint.get("path", "/metrics") != "/metrics":
            raise Failure("the PodMonitor scrapes %s, not /metrics" % endpoint["path"])
    # The job the prometheus-operator gives the PodMonitor's targets: the pod label named by jobLabel, else
    # `<namespace>/<name>`. GPUPluginDown reads `up` by that job, as the rules file spells it.
    job_label = monitor["spec"].get("jobLabel")
    job = labels.get(job_label) if job_label else None
    job = job or "%s/%s" % (monitor["metadata"].get("namespace"), monitor["metadata"]["name"])
    with open(RULES) as f:
        exprs = [r["expr"] for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
    read = set(m for e in exprs for m in re.findall(r'\bup\{job="([^"]*)"\}', e))
    if read != {job}:
        raise Failure("the rules read up for job %s; the PodMonitor's targets have job %r" % (sorted(read), job))
    dashboards = [c for c in by_kind["ConfigMap"] if c["metadata"].get("labels", {}).get("grafana_dashboard")]
    if not dashboards or json.loads(dashboards[0]["data"]["gpu-device-plugin.json"])["uid"] != "gpu-device-plugin":
        raise Failure("no ConfigMap with the dashboard for Grafana's sidecar")
    return len(docs)


def main():
    if sys.argv[1:] == ["--write"]:
        write()
        return
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    versions = sys.argv[2:] or ["1.37.0"]
    try:
        alerts = check_rules()
        queries = check_dashboard()
        objects = check_rendered(sys.argv[1], versions)
    except Failure as e:
        print("FAILED: %s" % e, file=sys.stderr)
        sys.exit(1)
    print("monitoring component: %d objects valid (PodMonitor and PrometheusRule against the prometheus-operator "
          "v0.93.0 CRDs, the rest against Kubernetes %s, strict); the PodMonitor matches the DaemonSet; %d alerts "
          "with runbooks in docs/alerts.md; %d dashboard queries" % (objects, " and ".join(versions), len(alerts),
                                                                     queries))


if __name__ == "__main__":
    main()
