//! Measure 12, `abuse` (this workspace's plugin only, issue 23): what the side surfaces cost the fault path
//! while they are abused. Every operator input is on (the fence directory, HTTP, the control socket, a config
//! file), and fault → kubelet is measured with them idle ("quiet") and, instance by instance in turn, under
//! abuse: half-open HTTP connections held (and opened again whenever the plugin closes one), a fence
//! directory full of reports for devices that are not on the node being rewritten without pause, and SIGHUP
//! every couple of seconds with the config file replaced by one far over the plugin's size limit. Also the
//! plugin's CPU time while the inputs are on but idle, and its resident memory before, at the peak of and
//! after the abuse.
//!
//! The plugin may misbehave (the point of the measure is to find out): every wait is bounded, a fault not
//! seen in time is counted as missed, and only a plugin that dies fails the run.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::Counts;
use crate::fault::one_fault_within;
use crate::process::{self, ProcSample};
use crate::report::{MemoryLabels, Report, Stats};
use crate::rig::{Plugin, Rig, WAIT, uuid};

mod claims_flood;

/// A fault the kubelet has not seen Unhealthy this long after its write is missed (counted, not waited for).
const MISSED_AFTER: Duration = Duration::from_secs(5);

/// How long the abuse may take to be all in place (every connection held, every report written) before the
/// faults begin anyway; what was in place is reported.
const ABUSE_READY: Duration = Duration::from_secs(10);

/// SIGHUP, with the oversized config in place, this often while the abuse lasts.
const SIGHUP_EVERY: Duration = Duration::from_secs(2);

/// Report rewrites per second (truncate and write, round-robin over the files), paced in 1 ms slices: a
/// detector gone wild, not the writer's own top speed, so that the writer does not take a processor of the
/// two from the plugin and the kubelet side by itself.
const REWRITES_PER_SECOND: usize = 10_000;

/// The partial request every abusive connection sends and then holds: a request line and the start of a
/// header, never finished.
const PARTIAL_REQUEST: &[u8] = b"GET /status HTTP/1.1\r\nHo";

/// After the abuse: how long the plugin may take to answer `/status` on a fresh connection, and to use no
/// CPU for [`QUIET_WINDOW`], before its memory is read anyway.
const SETTLE_LIMIT: Duration = Duration::from_secs(3);

/// No CPU tick in this long counts as idle again.
const QUIET_WINDOW: Duration = Duration::from_millis(500);

/// Device IDs the fence reports name: never a GPU of the node, so that no report fences a GPU the faults
/// need healthy.
fn unknown_device(n: usize) -> String {
    format!("GPU-0bad0000-0000-4000-8000-{n:012x}")
}

/// A config the plugin loads: our format, one setting.
const SMALL_CONFIG: &str = "health:\n  quietPeriod: 10m\n";

/// Which kind of instance.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Quiet,
    Abused,
}

/// One plugin instance with every input on, and where those inputs are.
struct Instance {
    plugin: Plugin,
    /// The registration it made (1-based over the run).
    registration: usize,
    http: SocketAddr,
    fence_dir: PathBuf,
    config: PathBuf,
    /// The state directory (with the control socket), the fence directory and the config file.
    _files: tempfile::TempDir,
    _state: tempfile::TempDir,
}

/// What the abuse did, summed over the abused instances.
#[derive(Default)]
struct Totals {
    closed_by_plugin: u64,
    connect_failures: u64,
    opened: u64,
    sighups: u64,
    rewrites: u64,
    /// Abused instances.
    instances: usize,
    /// Seconds the abuse was on, over every abused instance.
    abused_for: f64,
    /// Seconds the writer spent rewriting (after its first pass), for the rewrite rate.
    rewriting_for: f64,
    /// The fewest connections held when an instance's faults began.
    least_held: Option<i64>,
}

pub(crate) async fn abuse(
    rig: &Rig,
    devices: usize,
    counts: &Counts,
    report: &mut Report,
) -> anyhow::Result<()> {
    let (soft, hard) = raise_fd_limit()?;
    if (hard as usize) < counts.abuse_connections + 256 {
        eprintln!(
            "bench: abuse: the open-file limit is {soft} (hard {hard}); {} connections may not all be held",
            counts.abuse_connections
        );
    }
    let big_config = oversized_config(counts.abuse_config_bytes);
    let count = counts.faults;
    let (mut quiet, mut abused) = (Vec::new(), Vec::new());
    let (mut missed_quiet, mut missed_abused) = (0usize, 0usize);
    let (mut again_quiet, mut again_abused) = (0usize, 0usize);
    let mut totals = Totals::default();
    let mut idle = None;
    // Memory of each abused instance: before the abuse, its peak, after the abuse settled.
    let mut memory: Vec<(u64, u64, u64)> = Vec::new();
    let mut settled = 0usize;
    let mut status_after = Vec::new();
    let mut fenced = 0usize;
    let mut died = None;
    'instances: while quiet.len() + missed_quiet < count || abused.len() + missed_abused < count {
        for mode in [Mode::Quiet, Mode::Abused] {
            let done = match mode {
                Mode::Quiet => quiet.len() + missed_quiet,
                Mode::Abused => abused.len() + missed_abused,
            };
            let want = devices.min(count.saturating_sub(done));
            if want == 0 {
                continue;
            }
            let mut instance = start(rig, devices).await?;
            let pid = instance.plugin.pid();
            if mode == Mode::Quiet && idle.is_none() {
                let before = ProcSample::read(pid)?;
                tokio::time::sleep(counts.abuse_idle).await;
                let after = ProcSample::read(pid)?;
                idle = Some((before, after));
            }
            let before = ProcSample::read(pid)?;
            let running = match mode {
                Mode::Quiet => None,
                Mode::Abused => {
                    let abuse = Abuse::start(&instance, counts, &big_config)?;
                    let held = abuse.wait_ready(counts.abuse_connections).await;
                    totals.least_held = Some(totals.least_held.map_or(held, |l| l.min(held)));
                    Some(abuse)
                }
            };
            let n = instance.registration;
            {
                let kubelet = rig.kubelet.lock().await;
                for i in 0..want {
                    let sample = one_fault_within(rig, &kubelet, n, &uuid(i), MISSED_AFTER).await?;
                    match (mode, sample) {
                        (Mode::Quiet, Some(took)) => quiet.push(took),
                        (Mode::Quiet, None) => missed_quiet += 1,
                        (Mode::Abused, Some(took)) => abused.push(took),
                        (Mode::Abused, None) => missed_abused += 1,
                    }
                }
            }
            // A registration after the instance's first: it restarted in place or lost its stream.
            let again = rig.next_registration().await.saturating_sub(n + 1);
            match mode {
                Mode::Quiet => again_quiet += again,
                Mode::Abused => again_abused += again,
            }
            if let Some(abuse) = running {
                let ended = abuse.stop(&mut totals).await;
                remove_reports(&instance.fence_dir);
                if let Some(after) = settle(&instance, ended).await {
                    status_after.push(after.status_answered);
                    fenced = fenced.max(after.fenced);
                    settled += usize::from(after.quiet);
                }
                if let Ok(after) = ProcSample::read(pid) {
                    memory.push((before.rss_kib, after.hwm_kib, after.rss_kib));
                }
            }
            if let Ok(Some(status)) = instance.plugin.child.try_wait() {
                died = Some(format!(
                    "the plugin exited ({status}) during a{} instance; its log:\n{}",
                    if mode == Mode::Quiet {
                        " quiet"
                    } else {
                        "n abused"
                    },
                    instance.plugin.log()
                ));
                break 'instances;
            }
            instance.plugin.stop().await;
        }
    }

    let quiet_name = format!(
        "abuse: fault (XID 79) → kubelet sees Unhealthy, {devices} GPUs, every input on and idle (fence dir, HTTP, control socket, config file)"
    );
    let abused_name = format!(
        "abuse: fault (XID 79) → kubelet sees Unhealthy, {devices} GPUs, under abuse ({} half-open HTTP connections, {} fence reports rewritten, SIGHUP with a {:.1} MB config every {} s)",
        counts.abuse_connections,
        counts.abuse_reports,
        counts.abuse_config_bytes as f64 / 1e6,
        SIGHUP_EVERY.as_secs()
    );
    report.latency(&quiet_name, &quiet);
    report.latency(&abused_name, &abused);
    report.latency(
        "abuse: abuse ended → /status answered on a fresh connection",
        &status_after,
    );
    if let (Some(q), Some(a)) = (Stats::of(&quiet), Stats::of(&abused)) {
        report.value(
            "abuse: fault → kubelet p99, under abuse ÷ quiet",
            a.p99 / q.p99,
            "×",
        );
    }
    report.value(
        &format!(
            "abuse: faults missed (not seen within {} s), quiet",
            MISSED_AFTER.as_secs()
        ),
        missed_quiet as f64,
        "",
    );
    report.value(
        &format!(
            "abuse: faults missed (not seen within {} s), under abuse",
            MISSED_AFTER.as_secs()
        ),
        missed_abused as f64,
        "",
    );
    report.value(
        "abuse: registrations again (restarted in place or stream lost), quiet",
        again_quiet as f64,
        "",
    );
    report.value(
        "abuse: registrations again (restarted in place or stream lost), under abuse",
        again_abused as f64,
        "",
    );
    if let Some((before, after)) = idle {
        let secs = counts.abuse_idle.as_secs_f64();
        let cpu = format!("abuse: idle CPU time over {secs:.0} s, every input on");
        let wakeups = "abuse: idle voluntary context switches (wake-ups), every input on";
        after.report_idle(&before, counts.abuse_idle, report, [&cpu, wakeups]);
    }
    let instances = memory.len();
    if instances > 0 {
        report.memory(
            &memory,
            &MemoryLabels {
                before: &format!("abuse: RSS before the abuse (largest of {instances} instances)"),
                peak: "abuse: peak RSS during the abuse (VmHWM, largest)",
                after: Some("abuse: RSS after the abuse, settled (largest)"),
                growth: "abuse: RSS after − before the abuse (largest of the instances)",
            },
        );
        report.value(
            &format!(
                "abuse: instances idle again (no CPU tick in {} ms) within {} s of the abuse's end, of {instances}",
                QUIET_WINDOW.as_millis(),
                SETTLE_LIMIT.as_secs()
            ),
            settled as f64,
            "",
        );
    }
    report.value(
        "abuse: GPUs fenced by the reports for unknown devices (most in one instance)",
        fenced as f64,
        "",
    );
    report.value(
        &format!(
            "abuse: half-open HTTP connections held when the faults began (fewest, of {})",
            counts.abuse_connections
        ),
        totals.least_held.unwrap_or(0) as f64,
        "",
    );
    report.value(
        "abuse: half-open HTTP connections opened (the first of each, and every one opened again)",
        totals.opened as f64,
        "",
    );
    report.value(
        "abuse: half-open HTTP connections closed by the plugin",
        totals.closed_by_plugin as f64,
        "",
    );
    report.value(
        "abuse: HTTP connects that failed",
        totals.connect_failures as f64,
        "",
    );
    report.value(
        "abuse: fence report rewrites (truncate + write), after the first pass",
        if totals.rewriting_for > 0.0 {
            totals.rewrites as f64 / totals.rewriting_for
        } else {
            0.0
        },
        "/s",
    );
    report.value("abuse: SIGHUPs sent", totals.sighups as f64, "");
    if totals.instances > 0 {
        report.value(
            "abuse: time under abuse per abused instance (set-up, faults), average",
            totals.abused_for / totals.instances as f64,
            "s",
        );
    }
    report.check(
        "abuse: the plugin ran through every instance",
        died.is_none(),
        died.unwrap_or_default(),
    );
    claims_flood::claims_flood(rig, devices, counts, report).await
}

/// Raises this process's soft limit of open files to the hard one, so that it can hold the connections
/// (the plugin, its child, inherits it, as a container inherits its runtime's); returns both limits.
fn raise_fd_limit() -> anyhow::Result<(u64, u64)> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) =
        getrlimit(Resource::RLIMIT_NOFILE).context("cannot read the open-file limit")?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
            .with_context(|| format!("cannot raise the open-file limit from {soft} to {hard}"))?;
    }
    Ok((soft.max(hard), hard))
}

/// A config of about `bytes` bytes, over the plugin's size limit: YAML comment lines, then one key the
/// config does not have, so that it is refused even by a plugin that reads it all.
fn oversized_config(bytes: usize) -> Vec<u8> {
    const LINE: &str =
        "# a config file far larger than any real one: the plugin must refuse it and go on\n";
    let mut text = String::with_capacity(bytes + LINE.len());
    while text.len() < bytes {
        text.push_str(LINE);
    }
    text.push_str("notAConfigKey: true\n");
    text.into_bytes()
}

/// A port nobody listens on now, for the plugin's HTTP surfaces (it retries a taken one every few seconds,
/// which the wait for `/readyz` would show).
fn free_port() -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("cannot find a free port")?;
    Ok(listener.local_addr()?.port())
}

/// Starts an instance with every input on and idle, and waits until the kubelet lists every GPU healthy and
/// the HTTP surfaces answer.
async fn start(rig: &Rig, devices: usize) -> anyhow::Result<Instance> {
    let files = tempfile::tempdir_in(rig.work_dir())?;
    let state = tempfile::tempdir()?;
    let fence_dir = files.path().join("fence");
    std::fs::create_dir(&fence_dir)?;
    let config = files.path().join("config.yaml");
    std::fs::write(&config, SMALL_CONFIG)?;
    let http = SocketAddr::from(([127, 0, 0, 1], free_port()?));
    let path = |p: &Path| p.to_string_lossy().into_owned();
    let args = vec![
        "--fence-dir".to_string(),
        path(&fence_dir),
        "--http-addr".to_string(),
        http.to_string(),
        "--config-file".to_string(),
        path(&config),
    ];
    let registration = rig.next_registration().await;
    let plugin = rig.spawn_with(devices, Some(state.path()), &args, &[])?;
    rig.wait_registered(registration, &plugin).await?;
    crate::fault::wait_all_healthy(rig, registration, devices, &plugin).await?;
    // The HTTP surfaces start once the kubelet has the first registration: poll until they answer.
    let deadline = Instant::now() + WAIT;
    loop {
        if let Ok((200, _)) = http_get(http, "/readyz").await {
            break;
        }
        if Instant::now() > deadline {
            anyhow::bail!(
                "the plugin's HTTP surfaces on {http} did not answer /readyz within {WAIT:?}; plugin log:\n{}",
                plugin.log()
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if !state.path().join("control.sock").exists() {
        anyhow::bail!(
            "no control socket in the state directory; plugin log:\n{}",
            plugin.log()
        );
    }
    Ok(Instance {
        plugin,
        registration,
        http,
        fence_dir,
        config,
        _files: files,
        _state: state,
    })
}

/// GET `path` on a fresh connection: the status code and body. Bounded: a plugin that does not answer
/// within 2 s is an error.
async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, Vec<u8>)> {
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await?;
        stream
            .write_all(
                format!("GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await?;
        let mut answer = Vec::new();
        stream.take(16 << 20).read_to_end(&mut answer).await?;
        anyhow::Ok(answer)
    };
    let answer = tokio::time::timeout(Duration::from_secs(2), exchange)
        .await
        .context("no answer within 2 s")??;
    let text = String::from_utf8_lossy(&answer);
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("not an HTTP answer")?;
    let body = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or_else(Vec::new, |at| answer[at + 4..].to_vec());
    Ok((code, body))
}

/// Counters the abuse's connections share.
#[derive(Default)]
struct ConnectionCounts {
    /// Connections open with the partial request sent, now.
    held: AtomicI64,
    /// Connections that have made their first attempt (held, refused or closed at once).
    tried: AtomicU64,
    opened: AtomicU64,
    closed_by_plugin: AtomicU64,
    connect_failures: AtomicU64,
    sighups: AtomicU64,
}

/// The abuse of one instance, running: the connections and the SIGHUPs on a thread and runtime of their own,
/// the report writer on another, so that none of it runs on the thread that plays the kubelet.
struct Abuse {
    stop: watch::Sender<bool>,
    stop_writer: Arc<AtomicBool>,
    connections: ConnectionsThread,
    writer: std::thread::JoinHandle<anyhow::Result<(u64, Duration)>>,
    /// Set once every report file has been written once.
    written: Arc<AtomicBool>,
    counts: Arc<ConnectionCounts>,
    started: Instant,
}

type ConnectionsThread = std::thread::JoinHandle<anyhow::Result<()>>;

impl Abuse {
    /// Replaces the config file with the oversized one, then starts the connections, the SIGHUPs (the first
    /// at once) and the report writer.
    fn start(instance: &Instance, counts: &Counts, big_config: &[u8]) -> anyhow::Result<Self> {
        // Replaced as a ConfigMap update replaces it: written beside it, renamed over it.
        let staged = instance.config.with_extension("new");
        std::fs::write(&staged, big_config)?;
        std::fs::rename(&staged, &instance.config)?;
        let (stop, stopped) = watch::channel(false);
        let shared = Arc::new(ConnectionCounts::default());
        let (addr, pid, connections) = (
            instance.http,
            instance.plugin.pid(),
            counts.abuse_connections,
        );
        let thread_counts = shared.clone();
        let nice = counts.abuse_nice;
        let connections = std::thread::Builder::new()
            .name("abuse-http".into())
            .spawn(move || -> anyhow::Result<()> {
                lower_priority(nice);
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                runtime.block_on(hold_and_hup(addr, pid, connections, stopped, thread_counts));
                Ok(())
            })?;
        let stop_writer = Arc::new(AtomicBool::new(false));
        let written = Arc::new(AtomicBool::new(false));
        let writer = {
            let (dir, reports) = (instance.fence_dir.clone(), counts.abuse_reports);
            let (stop, written) = (stop_writer.clone(), written.clone());
            std::thread::Builder::new()
                .name("abuse-fence".into())
                .spawn(move || {
                    lower_priority(nice);
                    rewrite_reports(&dir, reports, &stop, &written)
                })?
        };
        Ok(Abuse {
            stop,
            stop_writer,
            connections,
            writer,
            written,
            counts: shared,
            started: Instant::now(),
        })
    }

    /// Waits until every connection has made its first attempt and every report is written once, for
    /// [`ABUSE_READY`] at most; returns the connections held then. (A plugin that caps its connections holds
    /// fewer: the wait is for the attempts, not for all to be held.)
    async fn wait_ready(&self, connections: usize) -> i64 {
        let deadline = Instant::now() + ABUSE_READY;
        loop {
            let held = self.counts.held.load(Ordering::SeqCst);
            let tried = self.counts.tried.load(Ordering::SeqCst) >= connections as u64;
            let all = tried && self.written.load(Ordering::SeqCst);
            if all || Instant::now() > deadline {
                return held;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Ends the abuse (every connection reset, the writer stopped), adds its counts to `totals`; returns
    /// when it ended.
    async fn stop(self, totals: &mut Totals) -> Instant {
        let _ = self.stop.send(true);
        self.stop_writer.store(true, Ordering::SeqCst);
        let (connections, writer) = (self.connections, self.writer);
        let joined = tokio::task::spawn_blocking(move || {
            let connections = connections.join();
            let writer = writer.join();
            (connections, writer)
        })
        .await;
        let ended = Instant::now();
        totals.instances += 1;
        totals.abused_for += ended.duration_since(self.started).as_secs_f64();
        match joined {
            Ok((connections, writer)) => {
                if let Ok(Err(e)) = connections {
                    eprintln!("bench: abuse: the connections' thread failed: {e:#}");
                }
                match writer {
                    Ok(Ok((rewrites, took))) => {
                        totals.rewrites += rewrites;
                        totals.rewriting_for += took.as_secs_f64();
                    }
                    Ok(Err(e)) => eprintln!("bench: abuse: the report writer failed: {e:#}"),
                    Err(_) => eprintln!("bench: abuse: the report writer panicked"),
                }
            }
            Err(e) => eprintln!("bench: abuse: cannot join the abuse's threads: {e}"),
        }
        let c = &self.counts;
        totals.opened += c.opened.load(Ordering::SeqCst);
        totals.closed_by_plugin += c.closed_by_plugin.load(Ordering::SeqCst);
        totals.connect_failures += c.connect_failures.load(Ordering::SeqCst);
        totals.sighups += c.sighups.load(Ordering::SeqCst);
        ended
    }
}

/// Holds `connections` half-open connections to `addr` and sends `pid` SIGHUP every [`SIGHUP_EVERY`] until
/// `stop`.
async fn hold_and_hup(
    addr: SocketAddr,
    pid: u32,
    connections: usize,
    mut stop: watch::Receiver<bool>,
    counts: Arc<ConnectionCounts>,
) {
    let mut held = tokio::task::JoinSet::new();
    for _ in 0..connections {
        held.spawn(hold(addr, stop.clone(), counts.clone()));
    }
    let mut every = tokio::time::interval(SIGHUP_EVERY);
    loop {
        tokio::select! {
            biased;
            _ = stop.changed() => break,
            _ = every.tick() => {
                let sent = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGHUP,
                );
                if sent.is_ok() {
                    counts.sighups.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
    }
    while held.join_next().await.is_some() {}
}

/// One abusive connection: connect, send the partial request, hold it; when the plugin closes it, count
/// that and open it again (after a pause that grows while the plugin keeps closing at once, so that a
/// plugin refusing connections does not turn this into a busy loop). Reset at `stop`.
async fn hold(addr: SocketAddr, mut stop: watch::Receiver<bool>, counts: Arc<ConnectionCounts>) {
    const FIRST_PAUSE: Duration = Duration::from_millis(50);
    const LONGEST_PAUSE: Duration = Duration::from_secs(1);
    let mut pause = FIRST_PAUSE;
    let mut first = true;
    loop {
        if *stop.borrow() {
            return;
        }
        let connected = tokio::select! {
            biased;
            _ = stop.changed() => return,
            connected = TcpStream::connect(addr) => connected,
        };
        let opened = Instant::now();
        match connected {
            Err(_) => {
                counts.connect_failures.fetch_add(1, Ordering::SeqCst);
            }
            Ok(mut stream) => {
                if stream.write_all(PARTIAL_REQUEST).await.is_err() {
                    counts.closed_by_plugin.fetch_add(1, Ordering::SeqCst);
                } else {
                    counts.opened.fetch_add(1, Ordering::SeqCst);
                    counts.held.fetch_add(1, Ordering::SeqCst);
                    if std::mem::take(&mut first) {
                        counts.tried.fetch_add(1, Ordering::SeqCst);
                    }
                    let mut buffer = [0u8; 1024];
                    loop {
                        tokio::select! {
                            biased;
                            _ = stop.changed() => {
                                // A reset, not a close: no TIME_WAIT left behind for every instance's
                                // connections.
                                let _ = stream.set_zero_linger();
                                counts.held.fetch_sub(1, Ordering::SeqCst);
                                return;
                            }
                            read = stream.read(&mut buffer) => match read {
                                Ok(0) | Err(_) => break,
                                // An answer (a timeout's 408, say) before the close.
                                Ok(_) => {}
                            },
                        }
                    }
                    counts.held.fetch_sub(1, Ordering::SeqCst);
                    counts.closed_by_plugin.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
        if std::mem::take(&mut first) {
            counts.tried.fetch_add(1, Ordering::SeqCst);
        }
        if opened.elapsed() > LONGEST_PAUSE {
            pause = FIRST_PAUSE;
        }
        tokio::select! {
            biased;
            _ = stop.changed() => return,
            () = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(LONGEST_PAUSE);
    }
}

/// Writes `reports` report files for unknown devices into `dir`, says so through `written`, then rewrites
/// them in place (truncate + write), round-robin, [`REWRITES_PER_SECOND`] paced in 1 ms slices, until
/// `stop`. Returns the rewrites and the time spent on them.
fn rewrite_reports(
    dir: &Path,
    reports: usize,
    stop: &AtomicBool,
    written: &AtomicBool,
) -> anyhow::Result<(u64, Duration)> {
    let reports = reports.max(1);
    let content = |n: usize| format!(r#"{{"device":"{}","reason":"r"}}"#, unknown_device(n));
    for n in 0..reports {
        if stop.load(Ordering::SeqCst) {
            return Ok((0, Duration::ZERO));
        }
        std::fs::write(dir.join(format!("{n}.json")), content(n))?;
    }
    written.store(true, Ordering::SeqCst);
    let per_ms = (REWRITES_PER_SECOND / 1000).max(1);
    let start = Instant::now();
    let mut rewrites = 0u64;
    let mut n = 0;
    let mut slice = 0u64;
    while !stop.load(Ordering::SeqCst) {
        for _ in 0..per_ms {
            std::fs::write(dir.join(format!("{n}.json")), content(n))?;
            n = (n + 1) % reports;
            rewrites += 1;
        }
        slice += 1;
        // Pacing: a load generator, not synchronisation.
        let next = start + Duration::from_millis(slice);
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
    Ok((rewrites, start.elapsed()))
}

/// Removes every report file from `dir` (a failure is only said: the instance ends soon anyway).
fn remove_reports(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if let Err(e) = std::fs::remove_file(entry.path()) {
            eprintln!(
                "bench: abuse: cannot remove {}: {e}",
                entry.path().display()
            );
        }
    }
}

/// How the plugin came back after the abuse.
struct Settled {
    /// From the abuse's end to `/status` answering on a fresh connection.
    status_answered: Duration,
    /// Devices `/status` shows fenced.
    fenced: usize,
    /// Whether it used no CPU for [`QUIET_WINDOW`] within [`SETTLE_LIMIT`].
    quiet: bool,
}

/// Waits, after the abuse ended at `ended`, for `/status` to answer and the plugin to be idle, each for
/// [`SETTLE_LIMIT`] at most; `None` if `/status` never answered.
async fn settle(instance: &Instance, ended: Instant) -> Option<Settled> {
    let deadline = Instant::now() + SETTLE_LIMIT;
    let (status_answered, body) = loop {
        if let Ok((200, body)) = http_get(instance.http, "/status").await {
            break (ended.elapsed(), body);
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let fenced = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|status| {
            status.get("devices")?.as_array().map(|devices| {
                devices
                    .iter()
                    .filter(|d| {
                        d.get("conditions")
                            .and_then(|c| c.as_array())
                            .is_some_and(|c| {
                                c.iter().any(|c| {
                                    c.get("kind").and_then(|k| k.as_str()) == Some("fenced")
                                })
                            })
                    })
                    .count()
            })
        })
        .unwrap_or(0);
    let quiet = process::settle(instance.plugin.pid(), QUIET_WINDOW, SETTLE_LIMIT).await;
    Some(Settled {
        status_answered,
        fenced,
        quiet,
    })
}

/// Adds `nice` to the calling thread's nice value (`--abuse-nice`); a failure only leaves it as it was.
fn lower_priority(nice: i32) {
    if nice == 0 {
        return;
    }
    let tid = rustix::thread::gettid();
    let lowered = rustix::process::getpriority_process(Some(tid))
        .and_then(|now| rustix::process::setpriority_process(Some(tid), (now + nice).min(19)));
    if let Err(e) = lowered {
        eprintln!("bench: abuse: cannot lower a thread's priority: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plugin refuses config files over 1 MiB before it parses them: the abuse's file must be over that
    /// in quick runs too, or SIGHUP would make the plugin parse it.
    #[test]
    fn the_oversized_config_is_over_the_plugins_limit_in_full_and_quick_runs() {
        for quick in [false, true] {
            let config = oversized_config(Counts::new(quick).abuse_config_bytes);
            assert!(config.len() > 1024 * 1024, "{} bytes", config.len());
            assert!(config.ends_with(b"notAConfigKey: true\n"));
        }
    }

    #[test]
    fn fence_reports_never_name_a_gpu_of_the_node() {
        for n in [0, 1, 7, 9_999] {
            assert!((0..512).all(|i| uuid(i) != unknown_device(n)));
        }
    }
}
