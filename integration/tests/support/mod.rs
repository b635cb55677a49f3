//! Helpers shared by the black-box tests: the real binary as a child process, and the library plugin on a
//! real socket when a test needs to inject faults.
#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    missing_docs
)]

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use gpu_device_plugin::devices::InventoryWatch;
use gpu_device_plugin::kubelet::{self, KubeletError, PluginConfig};
use gpu_device_plugin::monitor::{self, MonitorConfig};
use gpu_device_plugin::sources::simulated::{SimulatedControl, SimulatedGpus};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Upper bound for anything a test waits for; generous, because CI machines are slow and shared.
pub const WAIT: Duration = Duration::from_secs(20);

pub type TestResult = Result<(), Box<dyn std::error::Error>>;

/// The plugin binary, running.
pub struct PluginProcess {
    pub child: Child,
    log: PathBuf,
    _state: tempfile::TempDir,
}

impl PluginProcess {
    /// Spawns the binary on `kubelet_dir` with `args` added (typically `--simulate N`). Its log goes to a file
    /// that [`PluginProcess::log`] reads, for assertion messages.
    pub fn spawn(kubelet_dir: &Path, args: &[&str]) -> Self {
        Self::spawn_with_env(kubelet_dir, args, &[])
    }

    /// As [`PluginProcess::spawn`], with environment variables added.
    pub fn spawn_with_env(kubelet_dir: &Path, args: &[&str], envs: &[(&str, &OsStr)]) -> Self {
        let command = Command::new(env!("CARGO_BIN_EXE_gpu-device-plugin"));
        Self::spawn_command(command, kubelet_dir, args, envs)
    }

    /// Runs `command` (the binary, or something that execs it with the arguments that follow) with the
    /// arguments every test plugin gets and `args`, its log in a file [`PluginProcess::log`] reads.
    fn spawn_command(
        mut command: Command,
        kubelet_dir: &Path,
        args: &[&str],
        envs: &[(&str, &OsStr)],
    ) -> Self {
        let state = tempfile::tempdir().expect("temp dir");
        let log = state.path().join("plugin.log");
        let log_file = std::fs::File::create(&log).expect("log file");
        command.arg("--kubelet-dir").arg(kubelet_dir);
        if !args.contains(&"--state-dir") {
            command.arg("--state-dir").arg(state.path().join("state"));
        }
        // Tests run side by side: each plugin's HTTP surfaces on a port of their own.
        if !args.contains(&"--http-addr") {
            command.arg("--http-addr").arg("127.0.0.1:0");
        }
        // Nothing of the machine the tests run on: no kubelet's pod-resources socket, no API server from
        // the environment, unless the test names them.
        if !args.contains(&"--pod-resources-socket") {
            command
                .arg("--pod-resources-socket")
                .arg(state.path().join("no-pod-resources.sock"));
        }
        command
            .env_remove("KUBECONFIG")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("NODE_NAME");
        let child = command
            .args(args)
            .env("RUST_LOG", "debug")
            .envs(envs.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log_file))
            .kill_on_drop(true)
            .spawn()
            .expect("spawn gpu-device-plugin");
        PluginProcess {
            child,
            log,
            _state: state,
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The address the HTTP surfaces were bound to, from the log line that says so.
    pub async fn http_addr(&self) -> Option<String> {
        let log = self.wait_log(WAIT, |l| l.contains("serving HTTP")).await?;
        let line = log.lines().find(|l| l.contains("serving HTTP"))?;
        let addr = line.split("addr=").nth(1)?.split_whitespace().next()?;
        Some(addr.to_string())
    }

    /// Waits until the log satisfies `pred` (the log is written after the kubelet is told, so a test that
    /// saw a change at the kubelet waits for its log line); returns the log then.
    pub async fn wait_log(&self, timeout: Duration, pred: impl Fn(&str) -> bool) -> Option<String> {
        watch_until(&self.log, timeout, || Some(self.log()).filter(|l| pred(l))).await
    }

    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        let pid = self.child.id().expect("plugin is running");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal)
            .expect("send signal");
    }

    /// Waits for the process to exit within `timeout`.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        tokio::time::timeout(timeout, self.child.wait())
            .await
            .ok()?
            .ok()
    }
}

/// The plugin library serving simulated GPUs on a real socket, with a handle to inject faults.
pub struct InProcessPlugin {
    pub control: SimulatedControl,
    pub inventory: InventoryWatch,
    pub shutdown: CancellationToken,
    pub task: JoinHandle<Result<(), KubeletError>>,
}

impl InProcessPlugin {
    pub fn start(kubelet_dir: &Path, gpus: usize) -> Self {
        let (source, control) = SimulatedGpus::new(gpus);
        let inventory = monitor::spawn(Box::new(source), MonitorConfig::in_memory())
            .expect("simulated GPUs start");
        let shutdown = CancellationToken::new();
        let config = PluginConfig::new(kubelet_dir, "nvidia.com/gpu");
        let task = tokio::spawn(kubelet::run(config, inventory.clone(), shutdown.clone()));
        InProcessPlugin {
            control,
            inventory,
            shutdown,
            task,
        }
    }
}

impl Drop for InProcessPlugin {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Sorted, for reporting latencies in test output.
pub fn summary(mut samples: Vec<Duration>) -> String {
    samples.sort();
    let pick = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    format!(
        "n={} min={:?} p50={:?} p99={:?} max={:?}",
        samples.len(),
        samples[0],
        pick(0.5),
        pick(0.99),
        samples[samples.len() - 1]
    )
}

/// Waits until `check` gives a value, looking once at the start and again after every inotify event on
/// `watched` (a file or a directory), rather than polling; `None` if `timeout` passes first.
pub async fn watch_until<T>(
    watched: &Path,
    timeout: Duration,
    mut check: impl FnMut() -> Option<T>,
) -> Option<T> {
    use notify::Watcher;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut watcher = notify::recommended_watcher(move |_event| {
        let _ = tx.send(());
    })
    .ok()?;
    watcher
        .watch(watched, notify::RecursiveMode::NonRecursive)
        .ok()?;
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(found) = check() {
            return Some(found);
        }
        tokio::time::timeout_at(deadline, rx.recv()).await.ok()??;
    }
}

/// Waits until a file whose name satisfies `pred` exists in `dir`; returns its name.
pub async fn wait_for_file(
    dir: &Path,
    timeout: Duration,
    pred: impl Fn(&str) -> bool,
) -> Option<String> {
    watch_until(dir, timeout, || {
        std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .find(|n| pred(n))
    })
    .await
}

/// Waits until the file at `path` exists with content satisfying `pred` (its directory is watched, so a
/// write through a temporary file and a rename is seen); returns the content.
pub async fn wait_for_content(
    path: &Path,
    timeout: Duration,
    pred: impl Fn(&str) -> bool,
) -> Option<String> {
    watch_until(path.parent()?, timeout, || {
        std::fs::read_to_string(path).ok().filter(|t| pred(t))
    })
    .await
}

/// A fake kubelet and the binary on simulated GPUs that follow a fault script, registered and listing every
/// GPU Healthy.
pub struct ScriptedNode {
    pub kubelet: fake_kubelet::FakeKubelet,
    pub plugin: PluginProcess,
    pub faults: PathBuf,
    pub dir: tempfile::TempDir,
}

impl ScriptedNode {
    /// Starts the plugin on `gpus` simulated GPUs with `extra` arguments.
    pub async fn start(gpus: usize, extra: &[&str]) -> Result<Self, Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let faults = dir.path().join("faults");
        let kubelet = fake_kubelet::FakeKubelet::start(dir.path()).await?;
        let (count, faults_arg) = (gpus.to_string(), faults.to_string_lossy().into_owned());
        let mut args = vec!["--simulate", &count, "--simulate-events", &faults_arg];
        args.extend_from_slice(extra);
        let plugin = PluginProcess::spawn(dir.path(), &args);
        kubelet
            .wait_list("every GPU listed Healthy", WAIT, |l| {
                l.allocatable() == gpus
            })
            .await
            .map_err(|e| format!("{e}\n{}", plugin.log()))?;
        Ok(ScriptedNode {
            kubelet,
            plugin,
            faults,
            dir,
        })
    }

    /// Appends fault commands to the script.
    pub fn inject(&self, lines: &[String]) {
        append(&self.faults, lines);
    }
}

/// A fake kubelet and the in-process plugin on one temporary directory, registered and listing.
pub struct Node {
    pub kubelet: fake_kubelet::FakeKubelet,
    pub plugin: InProcessPlugin,
    pub registration: fake_kubelet::Registered,
    pub dir: tempfile::TempDir,
}

impl Node {
    pub async fn start(gpus: usize) -> Result<Node, Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let kubelet = fake_kubelet::FakeKubelet::start(dir.path()).await?;
        let plugin = InProcessPlugin::start(dir.path(), gpus);
        let registration = kubelet.wait_registrations(1, WAIT).await?.remove(0);
        kubelet
            .wait_list("first list", WAIT, |l| l.devices.len() == gpus)
            .await?;
        Ok(Node {
            kubelet,
            plugin,
            registration,
            dir,
        })
    }

    /// Reports XID `xid` on `id` and waits until the kubelet's list shows the device Unhealthy.
    pub async fn fail(
        &self,
        id: &str,
        xid: u64,
    ) -> Result<fake_kubelet::ListState, Box<dyn std::error::Error>> {
        self.plugin
            .control
            .observe(id, gpu_device_plugin::health::Observation::Xid(xid))
            .await;
        let what = format!("{id} unhealthy");
        Ok(self
            .kubelet
            .wait_list(&what, WAIT, |l| l.health(id) == Some("Unhealthy"))
            .await?)
    }
}

/// The fake `libnvidia-ml` for this build profile, built on first use (`cargo test` builds test targets,
/// not the workspace's cdylibs).
pub fn fake_nvml_lib() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            // target/<profile>/deps/<test binary> -> target/<profile>
            let exe = std::env::current_exe().expect("test binary path");
            let profile_dir = exe
                .parent()
                .and_then(Path::parent)
                .expect("target/<profile>")
                .to_path_buf();
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let mut build = std::process::Command::new(cargo);
            build.args(["build", "--quiet", "-p", "fake-nvml"]);
            // Cargo gives the test process its package's variables (CARGO_MANIFEST_DIR, CARGO_PKG_NAME, ...),
            // and ring's build script asks to be rerun when they change: passed on, they made this build
            // and the next `cargo test` each rebuild ring, kube and the plugin, on every run.
            for (name, _) in std::env::vars_os() {
                let name = name.to_string_lossy();
                if name.starts_with("CARGO_PKG_")
                    || name.starts_with("CARGO_BIN_")
                    || [
                        "CARGO_MANIFEST_DIR",
                        "CARGO_MANIFEST_PATH",
                        "CARGO_CRATE_NAME",
                        "CARGO_PRIMARY_PACKAGE",
                        "CARGO_TARGET_TMPDIR",
                        "OUT_DIR",
                    ]
                    .contains(&name.as_ref())
                {
                    build.env_remove(name.as_ref());
                }
            }
            if profile_dir.ends_with("release") {
                build.arg("--release");
            }
            let status = build.status().expect("run cargo build -p fake-nvml");
            assert!(status.success(), "cargo build -p fake-nvml failed");
            let lib = profile_dir.join("libfake_nvml.so");
            assert!(lib.exists(), "{} missing after build", lib.display());
            lib
        })
        .clone()
}

/// Appends lines to a fault script, as `echo ... >> file` does.
pub fn append(path: &Path, lines: &[String]) {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .expect("open fault script");
    for line in lines {
        writeln!(file, "{line}").expect("append to fault script");
    }
}

/// Peak resident set size of a process in KiB (VmHWM), from procfs.
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// UUID of the fake library's default GPU `index` (four when no config is given).
pub fn fake_nvml_gpu(index: usize) -> String {
    format!("GPU-fa4e0000-0000-4000-8000-{index:012x}")
}

/// Writes the driver's GPU list under `proc_root` (`driver/nvidia/gpus/<bus id>/information`) for the fake
/// library's first `gpus` default GPUs, as the driver shows it for GPUs it has initialised.
pub fn write_driver_gpu_list(proc_root: &Path, gpus: usize) {
    for index in 0..gpus {
        let dir = proc_root.join(format!("driver/nvidia/gpus/0000:{index:02x}:00.0"));
        std::fs::create_dir_all(&dir).expect("create the driver's GPU directory");
        let text = format!(
            "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 0\nGPU UUID: \t {}\nVideo BIOS: \t 96.00.99.00.01\nBus Type: \t PCIe\nDMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\nBus Location: \t 0000:{index:02x}:00.0\nDevice Minor: \t {index}\nGPU Firmware: \t 580.65.06\nGPU Excluded:\t No\n",
            fake_nvml_gpu(index)
        );
        std::fs::write(dir.join("information"), text).expect("write the driver's GPU information");
    }
}

/// A fake kubelet and the plugin binary on the fake NVML library, registered and listing. The plugin keeps
/// its state (checkpoint) and boot id file in the node's directory, so it can be restarted as on a node.
pub struct NvmlNode {
    pub kubelet: fake_kubelet::FakeKubelet,
    pub plugin: PluginProcess,
    pub events: PathBuf,
    pub dir: tempfile::TempDir,
    envs: Vec<(&'static str, PathBuf)>,
    extra: Vec<String>,
}

impl NvmlNode {
    /// Starts with the fake's GPUs from `config` (JSON; default four) and `extra` plugin arguments (a
    /// `--config FILE` argument may name `{dir}`, the node's directory).
    pub async fn start(
        config: Option<&str>,
        extra: &[&str],
    ) -> Result<Self, Box<dyn std::error::Error>> {
        Self::start_with_env(config, extra, &[]).await
    }

    /// As [`NvmlNode::start`], with more environment variables for the plugin (and the fake library in it).
    pub async fn start_with_env(
        config: Option<&str>,
        extra: &[&str],
        more_envs: &[(&'static str, PathBuf)],
    ) -> Result<Self, Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let kubelet_dir = dir.path().join("device-plugins");
        std::fs::create_dir(&kubelet_dir)?;
        let events = dir.path().join("events");
        std::fs::write(&events, "")?;
        std::fs::write(dir.path().join("boot_id"), "boot-1\n")?;
        let mut envs = vec![("FAKE_NVML_EVENTS", events.clone())];
        envs.extend(more_envs.iter().cloned());
        if let Some(config) = config {
            let path = dir.path().join("gpus.json");
            std::fs::write(&path, config)?;
            envs.push(("FAKE_NVML_CONFIG", path));
        }
        let extra: Vec<String> = extra
            .iter()
            .map(|a| a.replace("{dir}", &dir.path().to_string_lossy()))
            .collect();
        let kubelet = fake_kubelet::FakeKubelet::start(&kubelet_dir).await?;
        let plugin = Self::spawn_plugin(dir.path(), &envs, &extra);
        let node = NvmlNode {
            kubelet,
            plugin,
            events,
            dir,
            envs,
            extra,
        };
        node.wait_registered(1).await?;
        Ok(node)
    }

    fn spawn_plugin(
        dir: &Path,
        envs: &[(&'static str, PathBuf)],
        extra: &[String],
    ) -> PluginProcess {
        Self::spawn_plugin_under(dir, envs, extra, None)
    }

    /// As [`NvmlNode::spawn_plugin`], under an open-file limit of `soft`:`hard` when given (see
    /// [`PluginProcess::spawn_with_nofile`]).
    fn spawn_plugin_under(
        dir: &Path,
        envs: &[(&'static str, PathBuf)],
        extra: &[String],
        nofile: Option<(u64, u64)>,
    ) -> PluginProcess {
        let lib = fake_nvml_lib();
        let state = dir.join("state");
        let boot_id = dir.join("boot_id");
        let mut args = vec![
            "--nvml-lib",
            lib.to_str().expect("utf-8 path"),
            "--state-dir",
            state.to_str().expect("utf-8 path"),
            "--boot-id-file",
            boot_id.to_str().expect("utf-8 path"),
        ];
        args.extend(extra.iter().map(String::as_str));
        let envs: Vec<(&str, &OsStr)> = envs.iter().map(|(k, v)| (*k, v.as_os_str())).collect();
        let kubelet_dir = dir.join("device-plugins");
        match nofile {
            Some((soft, hard)) => {
                PluginProcess::spawn_with_nofile(&kubelet_dir, &args, &envs, soft, Some(hard))
            }
            None => PluginProcess::spawn_with_env(&kubelet_dir, &args, &envs),
        }
    }

    async fn wait_registered(
        &self,
        registration: usize,
    ) -> Result<fake_kubelet::ListState, Box<dyn std::error::Error>> {
        Ok(self
            .kubelet
            .wait_list("first list", WAIT, |l| {
                l.registration >= registration && l.messages >= 1
            })
            .await
            .map_err(|e| format!("{e}\n{}", self.plugin.log()))?)
    }

    /// Stops the plugin with SIGTERM and waits for it to exit.
    pub async fn stop_plugin(&mut self) -> Result<(), Box<dyn std::error::Error>> {
        self.plugin.signal(nix::sys::signal::Signal::SIGTERM);
        self.plugin
            .wait_exit(WAIT)
            .await
            .ok_or("plugin did not stop")?;
        Ok(())
    }

    /// Starts the plugin again (after [`NvmlNode::stop_plugin`]); returns the first list the kubelet gets
    /// from the new process.
    pub async fn start_plugin(
        &mut self,
    ) -> Result<fake_kubelet::ListState, Box<dyn std::error::Error>> {
        let next = self.kubelet.registrations().len() + 1;
        self.plugin = Self::spawn_plugin(self.dir.path(), &self.envs, &self.extra);
        self.wait_registered(next).await
    }

    /// Stops the plugin with SIGTERM and starts it again on the same state.
    pub async fn restart_plugin(
        &mut self,
    ) -> Result<fake_kubelet::ListState, Box<dyn std::error::Error>> {
        self.stop_plugin().await?;
        self.start_plugin().await
    }

    pub fn inject(&self, lines: &[String]) {
        append(&self.events, lines);
    }

    pub async fn wait_health(
        &self,
        id: &str,
        health: &str,
    ) -> Result<fake_kubelet::ListState, Box<dyn std::error::Error>> {
        let what = format!("{id} {health}");
        Ok(self
            .kubelet
            .wait_list(&what, WAIT, |l| l.health(id) == Some(health))
            .await
            .map_err(|e| format!("{e}\n{}", self.plugin.log()))?)
    }

    pub async fn wait_unhealthy(
        &self,
        id: &str,
    ) -> Result<fake_kubelet::ListState, Box<dyn std::error::Error>> {
        self.wait_health(id, "Unhealthy").await
    }

    /// The kubelet's Allocate of GPU `id` alone, which the test expects refused: the refusal, or an error
    /// (with the plugin's log) if it was granted.
    pub async fn refusal(&self, id: &str) -> Result<tonic::Status, Box<dyn std::error::Error>> {
        match self.kubelet.allocate(&[&[id]]).await {
            Err(status) => Ok(status),
            Ok(_) => Err(format!("Allocate of {id} was granted\n{}", self.plugin.log()).into()),
        }
    }

    /// Injects `lines` and waits until every GPU they name has taken them (see [`NvmlNode::marked_after`]),
    /// then injects XID 79 on GPU 3 and returns the first list in which the kubelet sees GPU 3 Unhealthy: the
    /// monitor publishes changes in the order it takes them, so that list holds every earlier line's effect.
    /// `lines` must leave GPU 3 Healthy.
    pub async fn list_after(
        &self,
        lines: &[String],
    ) -> Result<fake_kubelet::ListState, Box<dyn std::error::Error>> {
        self.marked_after(lines).await?;
        self.inject(&[format!("xid {} 79", fake_nvml_gpu(3))]);
        self.wait_unhealthy(&fake_nvml_gpu(3)).await
    }

    /// GPU 0's health after `lines` (see [`NvmlNode::list_after`]).
    pub async fn health_of_gpu0_after(
        &self,
        lines: &[String],
    ) -> Result<String, Box<dyn std::error::Error>> {
        let list = self.list_after(lines).await?;
        Ok(list
            .health(&fake_nvml_gpu(0))
            .unwrap_or("missing")
            .to_string())
    }
}

impl NvmlNode {
    /// Injects `lines`, then a harmless XID 43 (harmless under either XID policy) on every device their faults
    /// name, and waits until the monitor has taken each XID 43. Each GPU's events arrive in order, but GPUs'
    /// events do not arrive in the order written (each GPU has an event thread of its own): only a marker on
    /// every GPU named says that every line has had its effect.
    pub async fn marked_after(&self, lines: &[String]) -> Result<(), Box<dyn std::error::Error>> {
        let from = self.plugin.log().len();
        // Only faults: a lost GPU raises no event to mark it with.
        let mut named: Vec<String> = lines
            .iter()
            .filter_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
                ["xid" | "dbe" | "sbe", id, ..] => Some(id.to_string()),
                _ => None,
            })
            .collect();
        named.sort();
        named.dedup();
        let mut all = lines.to_vec();
        all.extend(named.iter().map(|id| format!("xid {id} 43")));
        self.inject(&all);
        // The first XID 43 on a device adds a condition (`xid-43`); a later one is an observation (`Xid(43)`).
        let recorded = |log: &str| {
            let new = log.get(from..).unwrap_or_default();
            named.iter().all(|id| {
                new.lines().any(|l| {
                    l.contains(id.as_str()) && (l.contains("xid-43") || l.contains("Xid(43)"))
                })
            })
        };
        self.plugin
            .wait_log(WAIT, recorded)
            .await
            .ok_or_else(|| format!("the marker XIDs were never recorded\n{}", self.plugin.log()))?;
        Ok(())
    }
}

/// CPU time a process has used so far, in clock ticks (user plus system, from `/proc/<pid>/stat`; 100 a
/// second on Linux).
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name, in parentheses, may hold spaces: the fields are counted after its closing one.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// Whether the kubelet's list showed device `id` with a given health while it was being recorded (see
/// [`record_health`]).
pub struct HealthRecord {
    seen: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: JoinHandle<()>,
}

impl HealthRecord {
    /// Stops recording; whether the health was seen.
    pub fn stop(self) -> bool {
        self.task.abort();
        self.seen.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Records from now on whether any list the kubelet gets shows device `id` with `health` (each list the fake
/// kubelet publishes is looked at, as the kubelet's own watch would see it).
pub fn record_health(kubelet: &fake_kubelet::FakeKubelet, id: &str, health: &str) -> HealthRecord {
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut lists = kubelet.watch_list();
    let (id, health, flag) = (id.to_string(), health.to_string(), seen.clone());
    let task = tokio::spawn(async move {
        loop {
            if lists.borrow_and_update().health(&id) == Some(health.as_str()) {
                flag.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            if lists.changed().await.is_err() {
                return;
            }
        }
    });
    HealthRecord { seen, task }
}

impl PluginProcess {
    /// As [`PluginProcess::spawn_with_env`], under an open-file limit of `soft`, and of `hard` when given:
    /// a shell sets them with `ulimit` and execs the binary in its place (same PID), as a container runtime
    /// hands a process its limits. The arguments added are those `spawn_with_env` adds.
    pub fn spawn_with_nofile(
        kubelet_dir: &Path,
        args: &[&str],
        envs: &[(&str, &OsStr)],
        soft: u64,
        hard: Option<u64>,
    ) -> Self {
        // The soft limit first: the hard one may not go below it.
        let mut script = format!("ulimit -Sn {soft}");
        if let Some(hard) = hard {
            script.push_str(&format!(" && ulimit -Hn {hard}"));
        }
        script.push_str(" && exec \"$0\" \"$@\"");
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(script)
            .arg(env!("CARGO_BIN_EXE_gpu-device-plugin"));
        Self::spawn_command(command, kubelet_dir, args, envs)
    }

    /// The process's soft and hard open-file limits, from `/proc/<pid>/limits`.
    pub fn open_files_limit(&self) -> Option<(u64, u64)> {
        let pid = self.child.id()?;
        let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
        let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
        let mut numbers = line
            .trim_start_matches("Max open files")
            .split_whitespace()
            .map(str::parse::<u64>);
        Some((numbers.next()?.ok()?, numbers.next()?.ok()?))
    }

    /// Descriptors the process holds now, from `/proc/<pid>/fd`.
    pub fn open_files(&self) -> Option<usize> {
        let pid = self.child.id()?;
        Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count())
    }
}

/// Resident set size of a process in KiB (VmRSS) now, from procfs.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Raises this test process's soft open-file limit to its hard one (tests that open thousands of
/// connections); returns the limit now. Raising is harmless to the other tests of the binary.
pub fn raise_own_open_files() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).expect("raise the soft open-file limit");
    }
    hard
}

/// Opens `count` TCP connections to `addr` that send the start of a request and never finish its headers.
/// Returns those that connected, and how many the server reset before the connect was seen through (a
/// server past its connection cap resets at once).
pub async fn half_open_http(addr: &str, count: usize) -> (Vec<tokio::net::TcpStream>, usize) {
    use tokio::io::AsyncWriteExt as _;
    let mut held = Vec::with_capacity(count);
    let mut reset = 0;
    for _ in 0..count {
        let mut stream = match tokio::net::TcpStream::connect(addr).await {
            Ok(stream) => stream,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                reset += 1;
                continue;
            }
            Err(e) => panic!("cannot connect to the plugin's HTTP port {addr}: {e}"),
        };
        // A connection the server has already closed may refuse the write: that is fine.
        let _sent = stream
            .write_all(b"GET /status HTTP/1.1\r\nhost: x\r\n")
            .await;
        held.push(stream);
    }
    (held, reset)
}

impl NvmlNode {
    /// Stops the plugin and starts it again on the same state under an open-file limit of `soft`:`hard`
    /// (see [`PluginProcess::spawn_with_nofile`]); returns the first list the kubelet gets from it.
    pub async fn restart_plugin_with_nofile(
        &mut self,
        soft: u64,
        hard: u64,
    ) -> Result<fake_kubelet::ListState, Box<dyn std::error::Error>> {
        self.stop_plugin().await?;
        let next = self.kubelet.registrations().len() + 1;
        self.plugin =
            Self::spawn_plugin_under(self.dir.path(), &self.envs, &self.extra, Some((soft, hard)));
        self.wait_registered(next).await
    }
}

/// Waits until the plugin has closed every one of `connections` (end of stream, or a reset), each within
/// [`WAIT`], and checks that `plugin` then holds at most a few more descriptors than `fds_before` (the API
/// server's connections and a checkpoint save come and go meanwhile).
pub async fn all_closed_by(
    plugin: &PluginProcess,
    connections: &mut [tokio::net::UnixStream],
    fds_before: usize,
) -> Result<(), String> {
    use tokio::io::AsyncReadExt as _;
    for (n, connection) in connections.iter_mut().enumerate() {
        let mut sent = Vec::new();
        tokio::time::timeout(WAIT, connection.read_to_end(&mut sent))
            .await
            .map_err(|_| format!("connection {n} still open"))?
            .ok();
    }
    let fds_after = plugin.open_files().ok_or("no /proc fd count")?;
    if fds_after > fds_before + 8 {
        return Err(format!(
            "{fds_before} descriptors before the flood, {fds_after} after"
        ));
    }
    Ok(())
}

/// The `MAX_CONCURRENT_STREAMS` the gRPC server on the Unix socket at `path` tells a new client (its first
/// SETTINGS frame), `None` when it sets none (unlimited).
pub async fn advertised_max_streams(path: &Path) -> Result<Option<u32>, String> {
    use futures_util::StreamExt as _;
    use tokio::io::AsyncWriteExt as _;
    let mut stream = tokio::net::UnixStream::connect(path)
        .await
        .map_err(|e| format!("cannot connect to {}: {e}", path.display()))?;
    // The preface and an empty SETTINGS frame, as every HTTP/2 client opens.
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend_from_slice(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
    stream.write_all(&hello).await.map_err(|e| e.to_string())?;
    let mut codec: h2::Codec<_, bytes::Bytes> = h2::Codec::new(stream);
    loop {
        let frame = tokio::time::timeout(WAIT, codec.next())
            .await
            .map_err(|_| "no SETTINGS within the wait".to_string())?
            .ok_or("the server closed the connection")?
            .map_err(|e| format!("{e:?}"))?;
        if let h2::frame::Frame::Settings(settings) = frame {
            if !settings.is_ack() {
                return Ok(settings.max_concurrent_streams());
            }
        }
    }
}
