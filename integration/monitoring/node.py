"""A node for the monitoring tests: the fake kubelet and the plugin binary on the fake NVML library, as
processes, the way a user runs them (integration/fake-nvml/README.md, integration/fake-kubelet/src/main.rs).

The plugin serves its HTTP surfaces on 127.0.0.1 only, on a port the kernel picks. Faults are lines appended
to the fake library's event file; a fence goes through the plugin's own `fence` command. Every wait is for an
observed change (a kubelet line, a scrape), bounded by WAIT_S.
"""

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TARGET = os.path.join(ROOT, "target", "debug")
PLUGIN = os.path.join(TARGET, "gpu-device-plugin")
FAKE_KUBELET = os.path.join(TARGET, "fake-kubelet")
FAKE_NVML = os.path.join(TARGET, "libfake_nvml.so")

# Upper bound of any wait for the plugin: generous, CI machines are slow and shared.
WAIT_S = 30


def gpu(index):
    """The fake library's UUID of GPU `index` (its default four GPUs)."""
    return "GPU-fa4e0000-0000-4000-8000-%012d" % index


class Failure(Exception):
    pass


class Lines:
    """A process's stdout, line by line, read by a thread of its own."""

    def __init__(self, stream):
        self.queue = queue.Queue()
        self.seen = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream):
        for line in stream:
            self.queue.put(line.rstrip("\n"))

    def wait(self, what, predicate, timeout=WAIT_S):
        deadline = time.monotonic() + timeout
        for line in self.seen:
            if predicate(line):
                return line
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Failure("no %s within %d s; seen: %s" % (what, timeout, self.seen[-10:]))
            try:
                line = self.queue.get(timeout=left)
            except queue.Empty:
                continue
            self.seen.append(line)
            if predicate(line):
                return line


class Node:
    """The fake kubelet and the plugin, with `config` as the plugin's config file (YAML text)."""

    def __init__(self, config="", gpus=4, dra=False):
        for path in (PLUGIN, FAKE_KUBELET, FAKE_NVML):
            if not os.path.exists(path):
                raise Failure("%s is missing: run `cargo build --workspace` first" % path)
        self.dir = tempfile.mkdtemp(prefix="gdp-monitoring-")
        self.kubelet_dir = os.path.join(self.dir, "device-plugins")
        os.mkdir(self.kubelet_dir)
        self.state = os.path.join(self.dir, "state")
        self.events = os.path.join(self.dir, "events")
        open(self.events, "w").close()
        with open(os.path.join(self.dir, "boot_id"), "w") as f:
            f.write("boot-1\n")
        self.config = os.path.join(self.dir, "config.yaml")
        with open(self.config, "w") as f:
            f.write(config)
        self.gpus = gpus
        # Every GPU through DRA: the fake kubelet is the kubelet's DRA side, with a fake API server.
        self.dra = dra
        self.kubelet = None
        self.plugin = None
        self.addr = None
        self.registrations = 0

    def __enter__(self):
        try:
            self.start_kubelet()
            self.start_plugin()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def start_kubelet(self):
        if self.dra:
            args = [FAKE_KUBELET, "--dir", self.dir, "--dra-node", "node-a"]
            ready = "api "
        else:
            args = [FAKE_KUBELET, "--dir", self.kubelet_dir]
            ready = "serving "
        self.kubelet = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        self.kubelet_lines = Lines(self.kubelet.stdout)
        self.kubelet_lines.wait("fake kubelet serving", lambda l: l.startswith(ready))

    def stop_kubelet(self):
        """Stops the fake kubelet (SIGTERM), as a kubelet restart begins."""
        self.kubelet.send_signal(signal.SIGTERM)
        self.kubelet.wait(timeout=WAIT_S)

    def start_plugin(self):
        env = dict(os.environ)
        for name in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "NODE_NAME"):
            env.pop(name, None)
        env["FAKE_NVML_EVENTS"] = self.events
        env["RUST_LOG"] = "info"
        self.log = os.path.join(self.dir, "plugin.log")
        self.plugin = subprocess.Popen(
            [PLUGIN, "--kubelet-dir", self.kubelet_dir, "--nvml-lib", FAKE_NVML,
             "--state-dir", self.state, "--boot-id-file", os.path.join(self.dir, "boot_id"),
             "--http-addr", "127.0.0.1:0", "--config", self.config,
             "--kube-api", "true" if self.dra else "false",
             "--pod-resources-socket", os.path.join(self.dir, "no-pod-resources.sock")]
            + (["--dra", "all", "--node-name", "node-a",
                "--kubeconfig", os.path.join(self.dir, "kubeconfig"),
                "--kubelet-registrar-directory-path", os.path.join(self.dir, "plugins_registry"),
                "--kubelet-plugins-directory-path", os.path.join(self.dir, "plugins")] if self.dra else []),
            env=env, stdout=subprocess.DEVNULL, stderr=open(self.log, "w"))
        self.wait_registered()
        self.addr = self._http_addr()

    def wait_registered(self):
        """Waits for the kubelet's next registration and its first device list."""
        if self.dra:
            self.kubelet_lines.wait("the DRA driver registered", lambda l: l.startswith("registered gpu.nvidia.com "))
            return
        self.registrations += 1
        n = self.registrations
        self.kubelet_lines.wait("registration %d" % n, lambda l: l.startswith("registered %d " % n))
        self.kubelet_lines.wait("first list of registration %d" % n,
                                lambda l: l.startswith("list %d " % n))

    def _http_addr(self):
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            match = re.search(r"serving HTTP.*?addr=(127\.0\.0\.1:\d+)", self.plugin_log())
            if match:
                return match.group(1)
            if self.plugin.poll() is not None:
                break
            time.sleep(0.05)  # polling a log file; the wait is bounded by the deadline above
        raise Failure("the plugin never said where it serves HTTP\n" + self.plugin_log())

    def plugin_log(self):
        with open(self.log) as f:
            return f.read()

    def inject(self, *lines):
        """Appends fault script lines (`xid <uuid> 79`, `lost <uuid>`, `restore <uuid>`)."""
        with open(self.events, "a") as f:
            for line in lines:
                f.write(line + "\n")

    def command(self, *args):
        """Runs `gpu-device-plugin <args>` against this plugin (fence, release); returns its output."""
        env = dict(os.environ, GPU_DEVICE_PLUGIN_STATE_DIR=self.state)
        done = subprocess.run([PLUGIN, *args], env=env, capture_output=True, text=True,
                              timeout=WAIT_S)
        if done.returncode != 0:
            raise Failure("gpu-device-plugin %s: %s" % (" ".join(args), done.stderr.strip()))
        return done.stdout

    def get(self, path, accept=None):
        request = urllib.request.Request("http://%s%s" % (self.addr, path))
        if accept:
            request.add_header("Accept", accept)
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.headers.get("content-type"), response.read().decode()

    def scrape(self):
        return self.get("/metrics")[1]

    def scrape_when(self, what, predicate, timeout=WAIT_S):
        """Scrapes until `predicate(samples)` holds (samples: parse(scrape)); returns that scrape's text."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.scrape()
            if predicate(parse(text)):
                return text
            if time.monotonic() > deadline:
                raise Failure("%s: not seen in /metrics within %d s\n%s\n%s"
                              % (what, timeout, text, self.plugin_log()[-4000:]))
            time.sleep(0.1)  # the next scrape; bounded by the deadline above

    def close(self):
        for process in (self.plugin, self.kubelet):
            if process and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=WAIT_S)
                except subprocess.TimeoutExpired:
                    process.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text):
    """The samples of an OpenMetrics/Prometheus text scrape: [(name, {label: value}, value)]."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = SAMPLE.match(line)
        if not match:
            raise Failure("cannot read the scrape line %r" % line)
        labels = dict((k, bytes(v, "utf-8").decode("unicode_escape")) for k, v in LABEL.findall(match.group(3) or ""))
        samples.append((match.group(1), labels, float(match.group(4))))
    return samples


def value(samples, name, **labels):
    """The value of the one sample `name` with (at least) `labels`, or None."""
    for n, l, v in samples:
        if n == name and all(l.get(k) == str(want) for k, want in labels.items()):
            return v
    return None


def main_guard(run):
    """Runs `run()`, printing a failure in one block and exiting non-zero."""
    try:
        run()
    except Failure as e:
        print("FAILED: %s" % e, file=sys.stderr)
        sys.exit(1)
