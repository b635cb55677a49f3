//! The test rig: the fake kubelet, the fake NVML library as `libnvidia-ml.so.1`, its GPU list and event file,
//! and the plugin under test as a child process.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use fake_kubelet::FakeKubelet;
use tokio::process::{Child, Command};
use tokio::sync::Mutex;

use crate::Args;

/// How long any single wait may take before the run is declared failed.
pub(crate) const WAIT: Duration = Duration::from_secs(30);

/// Everything the measures share.
pub(crate) struct Rig {
    pub(crate) kubelet: Mutex<FakeKubelet>,
    kubelet_dir: PathBuf,
    work: tempfile::TempDir,
    lib_dir: PathBuf,
    command: Vec<String>,
    /// The event file, opened for appending at the first fault.
    events_file: std::sync::Mutex<Option<std::fs::File>>,
}

/// A running plugin.
pub(crate) struct Plugin {
    pub(crate) child: Child,
    _state: tempfile::TempDir,
    log: PathBuf,
}

impl Plugin {
    /// The process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    /// The plugin's stderr so far, for error messages.
    pub(crate) fn log(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(20).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    /// The plugin's whole stderr so far.
    pub(crate) fn full_log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends `signal`; does not wait.
    pub(crate) fn signal(&self, signal: nix::sys::signal::Signal) {
        if let Some(pid) = self.child.id() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal);
        }
    }

    /// Sends SIGTERM, as the kubelet does to the old pod of a rolling update; does not wait.
    pub(crate) fn terminate(&self) {
        self.signal(nix::sys::signal::Signal::SIGTERM);
    }

    /// SIGKILL, and waits for it to be gone.
    pub(crate) async fn kill(mut self) {
        let _ = self.child.kill().await;
    }

    /// SIGTERM, then SIGKILL if it has not exited within 5 s.
    pub(crate) async fn stop(mut self) {
        self.terminate();
        if tokio::time::timeout(Duration::from_secs(5), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// UUID of MIG device `n` of fake GPU `gpu`, as the fake names it.
pub(crate) fn mig_uuid(gpu: usize, n: usize) -> String {
    format!("MIG-fa4e0000-{gpu:04x}-4000-8000-{n:012x}")
}

/// UUID of fake GPU `i` in every run.
pub(crate) fn uuid(i: usize) -> String {
    format!("GPU-be4c0000-0000-4000-8000-{i:012x}")
}

fn profile_dir() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot find the bench binary")?;
    exe.parent()
        .map(Path::to_path_buf)
        .context("bench binary has no directory")
}

/// Builds the fake library (and our plugin, when it is the one measured) in the bench's own profile.
fn build(with_plugin: bool) -> anyhow::Result<PathBuf> {
    let dir = profile_dir()?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = std::process::Command::new(cargo);
    build.args(["build", "--quiet", "-p", "fake-nvml"]);
    if with_plugin {
        // Target filters apply to every package named: without `--lib`, `--bin` alone would leave the fake
        // library out (it is built only when something else, `cargo test`, built it before).
        build.args([
            "-p",
            "gpu-device-plugin",
            "--lib",
            "--bin",
            "gpu-device-plugin",
        ]);
    }
    if dir.ends_with("release") {
        build.arg("--release");
    }
    let status = build.status().context("cannot run cargo build")?;
    if !status.success() {
        bail!("cargo build of the fake library failed");
    }
    Ok(dir)
}

impl Rig {
    /// Builds what is needed, links the fake library as `libnvidia-ml.so.1`, starts the fake kubelet.
    pub(crate) async fn new(args: &Args) -> anyhow::Result<Self> {
        let profile = build(args.plugin_cmd.is_none())?;
        // The fake driver's files (event file, GPU list, library link) go on tmpfs where there is one: a real
        // driver's events do not go through a file system, so the plugin's checkpoint fsync (its state stays
        // on the default temporary directory, normally disk) must not slow down the appends that stand in for
        // them.
        let shm = Path::new("/dev/shm");
        let work = if shm.is_dir() {
            tempfile::tempdir_in(shm)
        } else {
            tempfile::tempdir()
        }
        .context("cannot create a work directory")?;
        let lib_dir = work.path().join("lib");
        std::fs::create_dir(&lib_dir)?;
        std::os::unix::fs::symlink(
            profile.join("libfake_nvml.so"),
            lib_dir.join("libnvidia-ml.so.1"),
        )?;
        let kubelet_dir = match &args.kubelet_dir {
            Some(dir) => dir.clone(),
            None => work.path().join("device-plugins"),
        };
        std::fs::create_dir_all(&kubelet_dir)
            .with_context(|| format!("cannot create {}", kubelet_dir.display()))?;
        let template = match &args.plugin_cmd {
            Some(cmd) => cmd.clone(),
            None => format!(
                "{} --kubelet-dir {{kubelet_dir}} --state-dir {{state_dir}}",
                profile.join("gpu-device-plugin").display()
            ),
        };
        let command = shell_words::split(&template).context("cannot parse --plugin-cmd")?;
        if command.is_empty() {
            bail!("--plugin-cmd is empty");
        }
        let kubelet = FakeKubelet::start(&kubelet_dir).await?;
        let rig = Rig {
            kubelet: Mutex::new(kubelet),
            kubelet_dir,
            work,
            lib_dir,
            command,
            events_file: std::sync::Mutex::new(None),
        };
        Ok(rig)
    }

    /// The plugin command as run (with placeholders), for the report.
    pub(crate) fn plugin_command(&self) -> String {
        shell_words::join(&self.command)
    }

    /// The plugin's program, for its own commands (`gpu-device-plugin fence`).
    pub(crate) fn plugin_program(&self) -> &str {
        self.command.first().map_or("", String::as_str)
    }

    /// Whether the plugin measured is this workspace's (whose flags the measures may add to).
    pub(crate) fn is_ours(&self) -> bool {
        self.command
            .first()
            .is_some_and(|c| c.ends_with("/gpu-device-plugin"))
    }

    /// The work directory (tmpfs where there is one).
    pub(crate) fn work_dir(&self) -> &Path {
        self.work.path()
    }

    fn config(&self) -> PathBuf {
        self.work.path().join("gpus.json")
    }

    /// The fake library's event file.
    pub(crate) fn events(&self) -> PathBuf {
        self.work.path().join("events")
    }

    /// Starts the plugin on `devices` fake GPUs, with a fresh state directory and an empty event file.
    pub(crate) fn spawn(&self, devices: usize) -> anyhow::Result<Plugin> {
        self.spawn_with_state(devices, None)
    }

    /// As [`Rig::spawn`]; with `Some(dir)`, the plugin's `{state_dir}` is `dir`, shared with other instances
    /// as a DaemonSet's hostPath shares it between the two pods of a rolling update.
    pub(crate) fn spawn_with_state(
        &self,
        devices: usize,
        shared_state: Option<&Path>,
    ) -> anyhow::Result<Plugin> {
        self.spawn_with(devices, shared_state, &[], &[])
    }

    /// As [`Rig::spawn_with_state`], with arguments added to the plugin's command line and environment
    /// variables set.
    pub(crate) fn spawn_with(
        &self,
        devices: usize,
        shared_state: Option<&Path>,
        extra_args: &[String],
        envs: &[(&str, &std::ffi::OsStr)],
    ) -> anyhow::Result<Plugin> {
        self.spawn_on(devices, None, shared_state, extra_args, envs)
    }

    /// As [`Rig::spawn_with`], each fake GPU in MIG mode with MIG devices of the `migs` profiles when given
    /// (the fake names MIG device `j` of GPU `i` as [`mig_uuid`] does).
    pub(crate) fn spawn_on(
        &self,
        devices: usize,
        migs: Option<&[&str]>,
        shared_state: Option<&Path>,
        extra_args: &[String],
        envs: &[(&str, &std::ffi::OsStr)],
    ) -> anyhow::Result<Plugin> {
        self.spawn_process(devices, migs, shared_state, extra_args, envs, true)
    }

    /// Starts the plugin on `devices` fake GPUs and the state directory `state`; unless `fresh`, the fake
    /// driver's event file is kept, so that what it set (a GPU lost, a recovery action) holds in the new
    /// process as it would on a real GPU.
    pub(crate) fn spawn_keeping(
        &self,
        devices: usize,
        state: &Path,
        extra_args: &[String],
        fresh: bool,
    ) -> anyhow::Result<Plugin> {
        self.spawn_process(devices, None, Some(state), extra_args, &[], fresh)
    }

    fn spawn_process(
        &self,
        devices: usize,
        migs: Option<&[&str]>,
        shared_state: Option<&Path>,
        extra_args: &[String],
        envs: &[(&str, &std::ffi::OsStr)],
        fresh_events: bool,
    ) -> anyhow::Result<Plugin> {
        let mig = migs.map_or(String::new(), |profiles| {
            let each: Vec<String> = profiles
                .iter()
                .map(|p| format!(r#"{{"profile":"{p}"}}"#))
                .collect();
            format!(r#","mig":[{}]"#, each.join(","))
        });
        let list: Vec<String> = (0..devices)
            .map(|i| format!(r#"{{"uuid":"{}","minor":{i}{mig}}}"#, uuid(i)))
            .collect();
        std::fs::write(
            self.config(),
            format!(r#"{{"devices":[{}]}}"#, list.join(",")),
        )?;
        if fresh_events {
            std::fs::write(self.events(), "")?;
        }
        let state = tempfile::tempdir()?;
        let log = state.path().join("plugin.log");
        let state_dir = shared_state.map_or_else(|| state.path().join("state"), Path::to_path_buf);
        let fill = |arg: &String| {
            arg.replace("{kubelet_dir}", &self.kubelet_dir.to_string_lossy())
                .replace("{state_dir}", &state_dir.to_string_lossy())
        };
        let mut library_path = self.lib_dir.as_os_str().to_owned();
        if let Some(existing) = std::env::var_os("LD_LIBRARY_PATH") {
            library_path.push(":");
            library_path.push(existing);
        }
        let child = Command::new(fill(&self.command[0]))
            .args(self.command[1..].iter().map(fill))
            .args(extra_args)
            .envs(envs.iter().copied())
            .env("FAKE_NVML_CONFIG", self.config())
            .env("FAKE_NVML_EVENTS", self.events())
            .env("LD_LIBRARY_PATH", library_path)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot start the plugin: {}", self.command[0]))?;
        Ok(Plugin {
            child,
            _state: state,
            log,
        })
    }

    /// Appends lines to the event file in one write; returns when the write began. The file stays open
    /// across calls (and across the truncation at each start), so the time is that of the write alone, as
    /// a fault's is that of the fault.
    pub(crate) fn inject(&self, lines: &[String]) -> anyhow::Result<Instant> {
        let mut text = lines.join("\n");
        text.push('\n');
        let mut file = self
            .events_file
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if file.is_none() {
            *file = Some(
                std::fs::OpenOptions::new()
                    .append(true)
                    .open(self.events())?,
            );
        }
        let file = file.as_mut().context("event file not open")?;
        let at = Instant::now();
        file.write_all(text.as_bytes())?;
        Ok(at)
    }

    /// The number the next registration will have (1-based over the run).
    pub(crate) async fn next_registration(&self) -> usize {
        self.kubelet.lock().await.registrations().len() + 1
    }

    /// Waits for registration number `n` (1-based over the run) and the first list on its stream; returns
    /// when each arrived.
    pub(crate) async fn wait_registered(
        &self,
        n: usize,
        plugin: &Plugin,
    ) -> anyhow::Result<(std::time::Instant, std::time::Instant)> {
        let kubelet = self.kubelet.lock().await;
        let regs = kubelet
            .wait_registrations(n, WAIT)
            .await
            .with_context(|| format!("no registration #{n}; plugin log:\n{}", plugin.log()))?;
        let list = kubelet
            .wait_list("first list", WAIT, |l| {
                l.registration >= n && l.messages >= 1
            })
            .await
            .with_context(|| format!("no device list; plugin log:\n{}", plugin.log()))?;
        let listed = list.received_at.context("list without a time")?;
        Ok((regs[n - 1].received_at, listed))
    }
}
