"""Side-by-side fault -> kubelet latency on a real GPU: gpu-device-plugin and NVIDIA's plugin, each with its own
fake kubelet, both told to treat XID 31 as a fault (DP_ENABLE_HEALTHCHECKS=31); an injector raises the fault and
prints T_INJECT/T_ERR (CLOCK_MONOTONIC ns). Prints one JSON line per round and a summary, and writes hw.json,
both plugins' logs and this project's status and metrics after the first fault into OUT_DIR.

Usage: side_by_side.py BIN_DIR INJECT_COMMAND ROUNDS OUT_DIR   (as root: NVIDIA's plugin needs
/var/lib/kubelet/device-plugins; the results are in BENCHMARKS.md "On a real GPU")"""
import json, os, queue, re, shutil, signal, subprocess, sys, threading, time, statistics

BIN = sys.argv[1]            # folder with gpu-device-plugin, fake-kubelet, nvidia-device-plugin
INJECT = sys.argv[2]         # shell command raising one fault
ROUNDS = int(sys.argv[3])
OUT = sys.argv[4]
WORK = "/tmp/hw"; shutil.rmtree(WORK, ignore_errors=True)
# NVIDIA's plugin serves its own socket in the kubelet's default directory, whatever --kubelet-socket says
ours_dir, nv_dir, state = f"{WORK}/ours", "/var/lib/kubelet/device-plugins", f"{WORK}/state"
for d in (ours_dir, nv_dir, state): os.makedirs(d, exist_ok=True)
env = dict(os.environ, DP_ENABLE_HEALTHCHECKS="31")
cfg = f"{WORK}/config.yaml"
open(cfg, "w").write("health:\n  quietPeriod: 2s\n  probeInterval: 500ms\n")
log = open(f"{OUT}/ours.log", "w"); nvlog = open(f"{OUT}/nvidia.log", "w")

class Kubelet:
    def __init__(self, name, d):
        self.name, self.q = name, queue.Queue()
        self.p = subprocess.Popen([f"{BIN}/fake-kubelet", "--dir", d], stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self.read, daemon=True).start()
    def read(self):
        for line in self.p.stdout:
            self.q.put((time.monotonic_ns(), line.strip()))
    def wait(self, pattern, timeout=30):
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0: raise TimeoutError(f"{self.name}: no line matching {pattern!r}")
            try: t, line = self.q.get(timeout=left)
            except queue.Empty: continue
            if re.fullmatch(pattern, line): return t, line

def rss_kib(pid):
    for l in open(f"/proc/{pid}/status"):
        if l.startswith("VmRSS:"): return int(l.split()[1])

ko, kn = Kubelet("ours", ours_dir), Kubelet("nvidia", nv_dir)
ko.wait(r"serving .*"); kn.wait(r"serving .*")
t0 = time.monotonic_ns()
ours = subprocess.Popen([f"{BIN}/gpu-device-plugin", "--kubelet-dir", ours_dir, "--state-dir", state, "--config", cfg,
                         "--kube-api=false", "--pod-resources-socket", "", "--http-addr", "127.0.0.1:9412"],
                        env=env, stdout=log, stderr=subprocess.STDOUT)
t, line = ko.wait(r"list 1 (\d+)/(\d+)")
summary = {"ours_start_to_list_ms": (t - t0) / 1e6, "ours_first_list": line}
n_gpus = int(line.split()[2].split("/")[1])
healthy = rf"list (\d+) {n_gpus}/{n_gpus}"
def start_nvidia(reg):
    t0 = time.monotonic_ns()
    p = subprocess.Popen([f"{BIN}/nvidia-device-plugin", "--kubelet-socket", f"{nv_dir}/kubelet.sock",
                          "--fail-on-init-error=true"], env=env, stdout=nvlog, stderr=subprocess.STDOUT)
    t, line = kn.wait(rf"list {reg} {n_gpus}/{n_gpus}")
    return p, (t - t0) / 1e6
nv, summary["nvidia_start_to_list_ms"] = start_nvidia(1)
time.sleep(3)
summary["rss_kib_after_start"] = {"ours": rss_kib(ours.pid), "nvidia": rss_kib(nv.pid)}
rounds, reg = [], 1
for r in range(ROUNDS):
    inj = subprocess.run(INJECT, shell=True, capture_output=True, text=True, timeout=120)
    marks = dict(re.findall(r"(T_INJECT|T_ERR) (\d+)", inj.stdout))
    row = {"round": r, "inject_rc": inj.returncode, "inject_tail": (inj.stdout + inj.stderr)[-300:]}
    try:
        to, _ = ko.wait(rf"list \d+ {n_gpus-1}/{n_gpus}", timeout=10)
        tn, _ = kn.wait(rf"list \d+ {n_gpus-1}/{n_gpus}", timeout=10)
        ti, te = int(marks["T_INJECT"]), int(marks.get("T_ERR", marks["T_INJECT"]))
        row.update(ours_from_inject_ms=(to - ti) / 1e6, nvidia_from_inject_ms=(tn - ti) / 1e6,
                   ours_from_err_ms=(to - te) / 1e6, nvidia_from_err_ms=(tn - te) / 1e6,
                   ours_minus_nvidia_ms=(to - tn) / 1e6)
    except (TimeoutError, KeyError) as e:
        row["error"] = str(e)
    if r == 0:
        for args, name in ((["status"], "status.txt"), (["status", "--json"], "status.json")):
            s = subprocess.run([f"{BIN}/gpu-device-plugin"] + args + ["--addr", "127.0.0.1:9412"], capture_output=True, text=True)
            open(f"{OUT}/{name}", "w").write(s.stdout + s.stderr)
        m = subprocess.run(["curl", "-s", "127.0.0.1:9412/metrics"], capture_output=True, text=True)
        open(f"{OUT}/metrics.txt", "w").write(m.stdout)
    print(json.dumps(row), flush=True); rounds.append(row)
    # ours recovers by itself (quiet 2 s, then a probe); NVIDIA's is Unhealthy until restarted
    try:
        t, _ = ko.wait(healthy, timeout=15); row["ours_recovered"] = True
    except TimeoutError:
        row["ours_recovered"] = False
    nv.send_signal(signal.SIGTERM); nv.wait(timeout=20); reg += 1
    nv, _ = start_nvidia(reg); time.sleep(2)
ok = [x for x in rounds if "ours_from_err_ms" in x]
def stats(key):
    v = sorted(x[key] for x in ok)
    return {"min": v[0], "p50": statistics.median(v), "max": v[-1]} if v else None
for k in ("ours_from_inject_ms", "nvidia_from_inject_ms", "ours_from_err_ms", "nvidia_from_err_ms", "ours_minus_nvidia_ms"):
    summary[k] = stats(k)
summary["rounds_ok"], summary["rounds"] = len(ok), len(rounds)
summary["ours_recovered"] = sum(1 for x in rounds if x.get("ours_recovered"))
summary["rss_kib_end"] = {"ours": rss_kib(ours.pid), "nvidia": rss_kib(nv.pid)}
print("SUMMARY " + json.dumps(summary), flush=True)
json.dump({"summary": summary, "rounds": rounds}, open(f"{OUT}/hw.json", "w"), indent=1)
for p in (ours, nv, ko.p, kn.p): p.send_signal(signal.SIGTERM)
for p in (ours, nv, ko.p, kn.p): p.wait(timeout=20)
