//! The soak: this workspace's plugin run for a given time on fake GPUs under random faults of every kind
//! (fatal and harmless XIDs, double-bit ECC errors, single-bit bursts, a GPU lost and back, the driver's
//! recovery action set and cleared), operators' fences by command and detectors' fences by file, each
//! released again, plugin restarts by SIGTERM, SIGKILL and SIGHUP, SIGHUPs with a config that is refused,
//! kubelet restarts, a steady trickle of Allocate calls and HTTP scrapes of `/status` and `/metrics`: every
//! surface on. Beside it runs a model of the health policy: what each GPU's health must be,
//! and from when to when it may change. Every list the kubelet receives is compared with the model, and
//! every divergence is counted with what it was:
//!
//! - a GPU the model holds Healthy listed Unhealthy (or missing);
//! - a fault that does not reach the kubelet within [`DELIVERY`] (whatever else happened meanwhile: a
//!   GPU lost or back beside it is no excuse);
//! - a GPU listed Healthy again before its fault could have cleared;
//! - a GPU still Unhealthy [`SLACK`] past the latest time its fault clears (quiet period, a probe, the
//!   recovery action read again).
//!
//! Faults go only to GPUs the model holds Healthy, so each GPU's story is one fault and its recovery at a
//! time, and the model needs only the policy's timing, not its code. The fake driver's event file is kept
//! across plugin restarts, as a real GPU stays lost when the plugin restarts. Memory, threads, open file
//! descriptors and the checkpoint's size are sampled every [`SAMPLE_EVERY`].

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::process::ProcSample;
use crate::report::Report;
use crate::rig::{Plugin, Rig, WAIT, uuid};

/// The health timings the plugin runs with (its config file), short so that recoveries happen often.
const QUIET: Duration = Duration::from_secs(2);
const PROBE: Duration = Duration::from_millis(500);
const ACTION_INTERVAL: Duration = Duration::from_secs(1);
/// Single-bit errors tolerated within [`SBE_WINDOW`]; one more is a burst, made Unhealthy by the config
/// (the policy's default only records it).
const SBE_BURST: usize = 5;
const SBE_WINDOW: &str = "10s";

/// How long a fault may take to reach the kubelet before it counts as lost.
const DELIVERY: Duration = Duration::from_secs(5);
/// Allowance past the latest time a fault clears, for the scheduling of a loaded machine.
const SLACK: Duration = Duration::from_secs(3);
/// How much earlier than its earliest time a recovery may be seen (timer granularity).
const EARLY: Duration = Duration::from_millis(100);
/// Time between two steps of the chaos.
const STEP: Duration = Duration::from_millis(400);
const SAMPLE_EVERY: Duration = Duration::from_secs(10);
const ALLOCATE_EVERY: Duration = Duration::from_millis(100);
/// How often `/status` or `/metrics` is read (in turn).
const SCRAPE_EVERY: Duration = Duration::from_millis(250);

const LOST: &str = "the GPU lost";
const FENCED_BY_COMMAND: &str = "a fence by command";
const FENCED_BY_FILE: &str = "a fence by a detector's file";

/// What ends a fault when its time comes.
#[derive(Debug, Clone)]
enum Ending {
    /// A line for the fake driver (`restore`, `action 0`).
    Line(String),
    /// `gpu-device-plugin release` of the GPU.
    Release(String),
    /// The detector's report removed.
    RemoveReport(PathBuf),
}

/// XIDs the catalog makes Unhealthy, and XIDs it leaves Healthy (an application's faults, notices).
const FATAL_XIDS: &[u64] = &[48, 62, 64, 74, 79, 95, 109, 119, 140, 999];
const HARMLESS_XIDS: &[u64] = &[8, 13, 31, 43, 63, 92, 94];

/// What the model expects of one GPU.
#[derive(Debug, Clone)]
enum Expect {
    Healthy,
    /// A fault of `kind` at `at`: Unhealthy once it is delivered, Healthy again no earlier than
    /// `not_before` and no later than `healthy_by` (both unknown while a recovery step is pending).
    Faulted {
        kind: &'static str,
        at: Instant,
        /// The GPU's latest Unhealthy event, from which its quiet period counts.
        quiet_from: Instant,
        seen: bool,
        /// What ends the fault and when it is due.
        step: Option<(Instant, Ending)>,
        not_before: Instant,
        healthy_by: Instant,
        deliver_by: Instant,
    },
}

#[derive(Debug, Default)]
struct Tally {
    faults: usize,
    harmless: usize,
    recoveries: usize,
    sigterm_restarts: usize,
    sigkill_restarts: usize,
    kubelet_restarts: usize,
    allocations_ok: usize,
    /// Allocate of a GPU the model holds Healthy, refused.
    allocations_refused: usize,
    divergences: Vec<String>,
    recovery_after_earliest: Vec<Duration>,
    fences_by_command: usize,
    fences_by_file: usize,
    sighup_reloads: usize,
    sighup_refused: usize,
    scrapes_ok: usize,
    /// Scrapes that got no answer or a failed one while the plugin was running.
    scrapes_failed: usize,
}

/// One sample of the plugin process and its checkpoint.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Duration,
    rss_kib: u64,
    threads: u64,
    fds: u64,
    checkpoint_bytes: u64,
}

struct Soak<'a> {
    rig: &'a Rig,
    gpus: usize,
    state: PathBuf,
    args: Vec<String>,
    expect: Vec<Expect>,
    tally: Tally,
    /// The registration the checks follow: the latest of the running plugin.
    registration: usize,
    started: Instant,
    /// The plugin's config file (SIGHUP reads it again).
    config: PathBuf,
    /// The config's text as the plugin runs with it.
    config_text: String,
    /// Detectors' reports.
    fence_dir: PathBuf,
    /// The plugin's HTTP surfaces.
    http: std::net::SocketAddr,
    scrapes: usize,
}

/// Runs the soak for `duration` with `seed`, adding its results to `report`.
pub(crate) async fn run(
    rig: &Rig,
    gpus: usize,
    duration: Duration,
    seed: u64,
    report: &mut Report,
) -> anyhow::Result<()> {
    fastrand::seed(seed);
    let work = rig.work_dir();
    let state = work.join("soak-state");
    std::fs::create_dir_all(&state)?;
    let config = work.join("soak-config.yaml");
    let config_text = format!(
        "health:\n  quietPeriod: {}ms\n  probeInterval: {}ms\n  recoveryActionInterval: {}ms\n  sbeBurst: {{count: {SBE_BURST}, window: {SBE_WINDOW}}}\n  conditions:\n    ecc-sbe-burst: {{effect: unhealthy}}\n",
        QUIET.as_millis(),
        PROBE.as_millis(),
        ACTION_INTERVAL.as_millis()
    );
    std::fs::write(&config, &config_text)?;
    let fence_dir = work.join("soak-fence-dir");
    std::fs::create_dir_all(&fence_dir)?;
    // A port of its own for the HTTP surfaces, the same across restarts (SIGHUP restarts in place with the
    // same arguments).
    let http = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let proc_root = work.join("soak-proc");
    write_driver_gpu_list(&proc_root, gpus)?;
    let boot_id = work.join("soak-boot-id");
    std::fs::write(&boot_id, "soak-boot\n")?;
    let args = [
        "--config".as_ref(),
        config.as_os_str(),
        "--proc-root".as_ref(),
        proc_root.as_os_str(),
        "--boot-id-file".as_ref(),
        boot_id.as_os_str(),
        "--fence-dir".as_ref(),
        fence_dir.as_os_str(),
        "--http-addr".as_ref(),
        http.to_string().as_ref(),
    ]
    .iter()
    .map(|a| a.to_string_lossy().into_owned())
    .collect();
    let mut soak = Soak {
        rig,
        gpus,
        state,
        args,
        expect: vec![Expect::Healthy; gpus],
        tally: Tally::default(),
        registration: 0,
        started: Instant::now(),
        config,
        config_text,
        fence_dir,
        http,
        scrapes: 0,
    };
    let mut plugin = soak.start(true).await?;
    let mut samples = vec![soak.sample(&plugin)?];
    let mut first_of_process = samples.clone();
    let end = Instant::now() + duration;
    let mut next_step = Instant::now() + STEP;
    let mut next_sample = Instant::now() + SAMPLE_EVERY;
    let mut next_allocate = Instant::now() + ALLOCATE_EVERY;
    let mut next_scrape = Instant::now() + SCRAPE_EVERY;
    let mut lists = rig.kubelet.lock().await.watch_list();
    while Instant::now() < end {
        let wake = next_step
            .min(next_sample)
            .min(next_allocate)
            .min(next_scrape)
            .min(end);
        tokio::select! {
            changed = lists.changed() => {
                if changed.is_err() {
                    anyhow::bail!("the fake kubelet is gone");
                }
                let list = lists.borrow_and_update().clone();
                soak.compare(&list);
            }
            () = tokio::time::sleep_until(wake.into()) => {}
        }
        let now = Instant::now();
        soak.overdue(now).await;
        if now >= next_allocate {
            soak.allocate().await;
            next_allocate = now + ALLOCATE_EVERY;
        }
        if now >= next_scrape {
            soak.scrape().await;
            next_scrape = Instant::now() + SCRAPE_EVERY;
        }
        if now >= next_sample {
            samples.push(soak.sample(&plugin)?);
            next_sample = now + SAMPLE_EVERY;
        }
        if now >= next_step {
            let (next, restarted) = soak.step(plugin).await?;
            plugin = next;
            if restarted {
                // A new process: its first sample, to compare with its last.
                first_of_process.push(soak.sample(&plugin)?);
            }
            // What the kubelet holds now (the first list of a new registration came while the step waited
            // for it).
            let list = lists.borrow_and_update().clone();
            soak.compare(&list);
            next_step = Instant::now() + STEP;
        }
    }
    samples.push(soak.sample(&plugin)?);
    plugin.stop().await;
    soak.finish(&samples, &first_of_process, duration, seed, report);
    Ok(())
}

impl Soak<'_> {
    /// Starts a plugin on the shared state; `fresh` empties the fake driver's event file (the first start
    /// only: later ones keep it, so a lost GPU is still lost).
    async fn start(&mut self, fresh: bool) -> anyhow::Result<Plugin> {
        let n = self.rig.next_registration().await;
        let plugin = self
            .rig
            .spawn_keeping(self.gpus, &self.state, &self.args, fresh)?;
        self.rig.wait_registered(n, &plugin).await?;
        self.registration = self.rig.kubelet.lock().await.registrations().len();
        Ok(plugin)
    }

    fn diverged(&mut self, what: String) {
        let at = self.started.elapsed().as_secs_f64();
        eprintln!("soak: divergence at {at:.1}s: {what}");
        self.tally.divergences.push(format!("{at:.1}s: {what}"));
    }

    /// Compares a list with the model.
    fn compare(&mut self, list: &fake_kubelet::ListState) {
        if list.registration != self.registration || list.messages == 0 {
            return;
        }
        let now = Instant::now();
        for i in 0..self.gpus {
            let id = uuid(i);
            let health = list.health(&id);
            match &mut self.expect[i] {
                Expect::Healthy => {
                    if health != Some("Healthy") {
                        let what = format!("{id} listed {health:?}, the model holds it Healthy");
                        self.diverged(what);
                    }
                }
                Expect::Faulted {
                    kind,
                    at,
                    seen,
                    step,
                    not_before,
                    ..
                } => match health {
                    Some("Unhealthy") => *seen = true,
                    Some("Healthy") if *seen => {
                        let kind = *kind;
                        let since = now.duration_since(*at);
                        if step.is_some() || now + EARLY < *not_before {
                            let what = format!(
                                "{id} Healthy again {since:?} after {kind}, before it could clear"
                            );
                            self.diverged(what);
                        } else {
                            self.tally
                                .recovery_after_earliest
                                .push(now.saturating_duration_since(*not_before));
                        }
                        self.tally.recoveries += 1;
                        self.expect[i] = Expect::Healthy;
                    }
                    Some("Healthy") => {}
                    other => {
                        let what = format!("{id} listed {other:?} while faulted ({kind})");
                        self.diverged(what);
                    }
                },
            }
        }
    }

    /// Faults past their deadlines; due recovery steps.
    async fn overdue(&mut self, now: Instant) {
        for i in 0..self.gpus {
            let Expect::Faulted {
                kind,
                at,
                quiet_from,
                seen,
                step,
                not_before,
                healthy_by,
                deliver_by,
            } = &mut self.expect[i]
            else {
                continue;
            };
            let kind = *kind;
            if let Some((due, line)) = step
                && *due <= now
            {
                let ending = line.clone();
                *step = None;
                // A lost GPU clears once it answers a probe after its quiet period; a recovery action as
                // soon as the driver reads None (the XID 154 that announces it makes the plugin read it); a
                // fence as soon as it is released.
                let quiet_end = *quiet_from + QUIET;
                *not_before = if kind == LOST {
                    now.max(quiet_end)
                } else {
                    now
                };
                *healthy_by = match ending {
                    Ending::Line(_) => now.max(quiet_end) + PROBE + ACTION_INTERVAL + SLACK,
                    Ending::Release(_) | Ending::RemoveReport(_) => now + SLACK,
                };
                if let Err(e) = self.end(ending).await {
                    self.diverged(format!("cannot end {kind} on {}: {e}", uuid(i)));
                }
                continue;
            }
            let id = uuid(i);
            if !*seen && now > *deliver_by {
                let waited = now.duration_since(*at);
                self.diverged(format!(
                    "{kind} on {id} not listed Unhealthy after {waited:?}"
                ));
                self.expect[i] = Expect::Healthy;
            } else if step.is_none() && now > *healthy_by {
                let waited = now.duration_since(*at);
                self.diverged(format!(
                    "{id} still Unhealthy {waited:?} after {kind}, past the latest it clears"
                ));
                self.expect[i] = Expect::Healthy;
            }
        }
    }

    /// One random step of the chaos; returns the plugin (a new one after a plugin restart, with `true`).
    async fn step(&mut self, plugin: Plugin) -> anyhow::Result<(Plugin, bool)> {
        let roll = fastrand::f64();
        // A fault the plugin has not yet shown the kubelet may die with the process that read it, as a
        // driver event does when no one is waiting for it: restarts wait until every fault is listed.
        let undelivered = self
            .expect
            .iter()
            .any(|e| matches!(e, Expect::Faulted { seen: false, .. }));
        if roll < 0.016 && undelivered {
            return Ok((plugin, false));
        }
        if roll < 0.008 {
            return self.restart_plugin(plugin, false).await;
        }
        if roll < 0.016 {
            return self.restart_plugin(plugin, true).await;
        }
        if roll < 0.028 {
            self.restart_kubelet(&plugin).await?;
            return Ok((plugin, false));
        }
        if roll < 0.032 {
            self.sighup_refused(&plugin).await?;
            return Ok((plugin, false));
        }
        if roll < 0.036 && !undelivered {
            self.sighup_reload(&plugin).await?;
            return Ok((plugin, true));
        }
        if roll < 0.15 {
            let gpu = fastrand::usize(..self.gpus);
            let xid = HARMLESS_XIDS[fastrand::usize(..HARMLESS_XIDS.len())];
            self.rig.inject(&[format!("xid {} {xid}", uuid(gpu))])?;
            self.tally.harmless += 1;
            return Ok((plugin, false));
        }
        let healthy: Vec<usize> = (0..self.gpus)
            .filter(|&i| matches!(self.expect[i], Expect::Healthy))
            .collect();
        if roll < 0.6 && !healthy.is_empty() {
            let gpu = healthy[fastrand::usize(..healthy.len())];
            self.fault(gpu).await?;
        }
        Ok((plugin, false))
    }

    /// Ends a fault: a line for the driver, a release by command, a report removed.
    async fn end(&self, ending: Ending) -> anyhow::Result<()> {
        match ending {
            Ending::Line(line) => {
                self.rig.inject(&[line])?;
            }
            Ending::Release(id) => self.command(&["release", &id]).await?,
            Ending::RemoveReport(path) => std::fs::remove_file(&path)
                .with_context(|| format!("cannot remove {}", path.display()))?,
        }
        Ok(())
    }

    /// `gpu-device-plugin <args> --state-dir <the soak's>`, as an operator on the node runs it.
    async fn command(&self, args: &[&str]) -> anyhow::Result<()> {
        let out = tokio::process::Command::new(self.rig.plugin_program())
            .args(args)
            .arg("--state-dir")
            .arg(&self.state)
            .env_remove("RUST_LOG")
            .output()
            .await?;
        if !out.status.success() {
            anyhow::bail!(
                "gpu-device-plugin {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// Reads `/status` or `/metrics` (in turn) as a scraper would: one request on a new connection.
    async fn scrape(&mut self) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let path = if self.scrapes.is_multiple_of(2) {
            "/status"
        } else {
            "/metrics"
        };
        self.scrapes += 1;
        let exchange = async {
            let mut stream = tokio::net::TcpStream::connect(self.http).await?;
            stream
                .write_all(
                    format!("GET {path} HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n")
                        .as_bytes(),
                )
                .await?;
            let mut answer = Vec::new();
            stream.read_to_end(&mut answer).await?;
            Ok::<_, std::io::Error>(answer.starts_with(b"HTTP/1.1 200"))
        };
        match tokio::time::timeout(Duration::from_secs(2), exchange).await {
            Ok(Ok(true)) => self.tally.scrapes_ok += 1,
            // The HTTP surfaces start a little after registration, and a restart drops them: a refused
            // connection is not a failed scrape.
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
            outcome => {
                self.tally.scrapes_failed += 1;
                eprintln!("soak: {path} scrape failed: {outcome:?}");
            }
        }
    }

    /// SIGHUP with a config that does not load: refused, the plugin goes on as it is. The good config is
    /// put back once the plugin has said so.
    async fn sighup_refused(&mut self, plugin: &Plugin) -> anyhow::Result<()> {
        let refusals = |log: &str| log.matches("new config refused").count();
        let before = refusals(&plugin.full_log());
        std::fs::write(&self.config, format!("{}  bogus: 1\n", self.config_text))?;
        plugin.signal(nix::sys::signal::Signal::SIGHUP);
        let deadline = Instant::now() + WAIT;
        while refusals(&plugin.full_log()) == before {
            if Instant::now() > deadline {
                anyhow::bail!(
                    "a refused config was never said to be refused:\n{}",
                    plugin.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        std::fs::write(&self.config, &self.config_text)?;
        self.tally.sighup_refused += 1;
        Ok(())
    }

    /// SIGHUP with the config it runs with: the plugin restarts in place (same process), registers again,
    /// and lists from its checkpoint.
    async fn sighup_reload(&mut self, plugin: &Plugin) -> anyhow::Result<()> {
        let began = Instant::now();
        let n = self.rig.next_registration().await;
        plugin.signal(nix::sys::signal::Signal::SIGHUP);
        self.rig.wait_registered(n, plugin).await?;
        self.registration = self.rig.kubelet.lock().await.registrations().len();
        self.tally.sighup_reloads += 1;
        self.restarted(began.elapsed());
        Ok(())
    }

    async fn fault(&mut self, gpu: usize) -> anyhow::Result<()> {
        let id = uuid(gpu);
        let hold = Duration::from_millis(fastrand::u64(500..4000));
        let roll = fastrand::u8(..7);
        if roll >= 5 {
            let (kind, ending) = if roll == 5 {
                let fenced = self
                    .command(&["fence", &id, "--reason", "soak: burn-in failed"])
                    .await;
                if let Err(e) = fenced {
                    self.diverged(format!("cannot fence {id}: {e}"));
                    return Ok(());
                }
                self.tally.fences_by_command += 1;
                (FENCED_BY_COMMAND, Ending::Release(id.clone()))
            } else {
                let report = self.fence_dir.join(format!("gpu{gpu}.json"));
                let staged = self.fence_dir.join(format!(".gpu{gpu}.json.tmp"));
                std::fs::write(
                    &staged,
                    format!(
                        r#"{{"device": "{id}", "reason": "soak: NVLink errors", "by": "soak"}}"#
                    ),
                )?;
                std::fs::rename(&staged, &report)?;
                self.tally.fences_by_file += 1;
                (FENCED_BY_FILE, Ending::RemoveReport(report))
            };
            let at = Instant::now();
            self.expect[gpu] = Expect::Faulted {
                kind,
                at,
                quiet_from: at,
                seen: false,
                // Released at once when its ending comes.
                not_before: at + hold,
                healthy_by: at + hold + SLACK,
                deliver_by: at + DELIVERY,
                step: Some((at + hold, ending)),
            };
            self.tally.faults += 1;
            return Ok(());
        }
        let (kind, lines, step): (&'static str, Vec<String>, Option<String>) = match roll {
            0 => {
                let xid = FATAL_XIDS[fastrand::usize(..FATAL_XIDS.len())];
                ("a fatal XID", vec![format!("xid {id} {xid}")], None)
            }
            1 => ("a double-bit ECC error", vec![format!("dbe {id}")], None),
            2 => (
                "a single-bit ECC burst",
                vec![format!("sbe {id}"); SBE_BURST + 1],
                None,
            ),
            3 => (
                LOST,
                vec![format!("lost {id}")],
                Some(format!("restore {id}")),
            ),
            _ => {
                let action = fastrand::u32(1..=4);
                (
                    "a recovery action",
                    vec![format!("action {id} {action}")],
                    Some(format!("action {id} 0")),
                )
            }
        };
        let at = self.rig.inject(&lines)?;
        let step = step.map(|line| (at + hold, Ending::Line(line)));
        let not_before = at + QUIET;
        self.expect[gpu] = Expect::Faulted {
            kind,
            at,
            quiet_from: at,
            seen: false,
            not_before,
            healthy_by: not_before + PROBE + ACTION_INTERVAL + SLACK,
            deliver_by: at + DELIVERY,
            step,
        };
        self.tally.faults += 1;
        Ok(())
    }

    /// Stops the plugin (SIGKILL or SIGTERM) and starts a new one on the same state. Deadlines move by the
    /// time it was away, and a lost GPU is reported lost again at start (a new event: its quiet period
    /// starts again).
    async fn restart_plugin(
        &mut self,
        plugin: Plugin,
        kill: bool,
    ) -> anyhow::Result<(Plugin, bool)> {
        let began = Instant::now();
        if kill {
            plugin.kill().await;
            self.tally.sigkill_restarts += 1;
        } else {
            plugin.stop().await;
            self.tally.sigterm_restarts += 1;
        }
        let plugin = self.start(false).await?;
        self.restarted(began.elapsed());
        Ok((plugin, true))
    }

    /// After a new process or a restart in place: deadlines move by the time it was away, and a lost GPU is
    /// reported lost again at start (a new event: its quiet period starts again).
    fn restarted(&mut self, away: Duration) {
        self.postpone(away);
        let now = Instant::now();
        for expect in &mut self.expect {
            if let Expect::Faulted {
                kind,
                quiet_from,
                step,
                ..
            } = expect
                // Still lost: the new process reports it lost at start, a new Unhealthy event.
                && *kind == LOST
                && step.is_some()
            {
                *quiet_from = now;
            }
        }
    }

    async fn restart_kubelet(&mut self, plugin: &Plugin) -> anyhow::Result<()> {
        let began = Instant::now();
        {
            let mut kubelet = self.rig.kubelet.lock().await;
            kubelet.restart_and_wait(WAIT).await.with_context(|| {
                format!("no registration after a kubelet restart:\n{}", plugin.log())
            })?;
            let n = kubelet.registrations().len();
            kubelet
                .wait_list("list after a kubelet restart", WAIT, |l| {
                    l.registration >= n && l.messages >= 1
                })
                .await
                .with_context(|| format!("no list after a kubelet restart:\n{}", plugin.log()))?;
            self.registration = kubelet.registrations().len();
        }
        self.tally.kubelet_restarts += 1;
        self.postpone(began.elapsed());
        Ok(())
    }

    /// Moves every fault's deadlines by `away`, the time the plugin or the kubelet was gone.
    fn postpone(&mut self, away: Duration) {
        for expect in &mut self.expect {
            if let Expect::Faulted {
                deliver_by,
                healthy_by,
                ..
            } = expect
            {
                *deliver_by += away;
                *healthy_by += away;
            }
        }
    }

    /// Allocates one GPU the model holds Healthy and the kubelet lists Healthy.
    async fn allocate(&mut self) {
        let kubelet = self.rig.kubelet.lock().await;
        let list = kubelet.list();
        if list.registration != self.registration {
            return;
        }
        let candidates: Vec<String> = (0..self.gpus)
            .filter(|&i| matches!(self.expect[i], Expect::Healthy))
            .map(uuid)
            .filter(|id| list.health(id) == Some("Healthy"))
            .collect();
        if candidates.is_empty() {
            return;
        }
        let id = &candidates[fastrand::usize(..candidates.len())];
        match kubelet.allocate(&[&[id.as_str()]]).await {
            Ok(_) => self.tally.allocations_ok += 1,
            Err(status) => {
                self.tally.allocations_refused += 1;
                eprintln!("soak: Allocate of {id} refused: {status}");
            }
        }
    }

    fn sample(&self, plugin: &Plugin) -> anyhow::Result<Sample> {
        let pid = plugin.pid();
        let proc = ProcSample::read(pid)?;
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| d.count() as u64)
            .unwrap_or(0);
        let checkpoint_bytes = std::fs::metadata(self.state.join("health-checkpoint.json"))
            .map(|m| m.len())
            .unwrap_or(0);
        Ok(Sample {
            at: self.started.elapsed(),
            rss_kib: proc.rss_kib,
            threads: proc.threads,
            fds,
            checkpoint_bytes,
        })
    }

    fn finish(
        self,
        samples: &[Sample],
        firsts: &[Sample],
        duration: Duration,
        seed: u64,
        report: &mut Report,
    ) {
        let t = &self.tally;
        let first = samples.first().copied();
        let last = samples.last().copied();
        let max = |f: fn(&Sample) -> u64| samples.iter().map(f).max().unwrap_or(0);
        report.value("soak: duration", duration.as_secs_f64() / 60.0, "min");
        report.value("soak: seed", seed as f64, "");
        let counted = [
            ("soak: faults injected", t.faults),
            ("soak: harmless XIDs injected", t.harmless),
            ("soak: recoveries seen", t.recoveries),
            ("soak: plugin restarts by SIGTERM", t.sigterm_restarts),
            ("soak: plugin restarts by SIGKILL", t.sigkill_restarts),
            ("soak: kubelet restarts", t.kubelet_restarts),
            ("soak: Allocate calls granted", t.allocations_ok),
            (
                "soak: fences by command (released by command)",
                t.fences_by_command,
            ),
            (
                "soak: fences by a detector's file (released by removing it)",
                t.fences_by_file,
            ),
            ("soak: plugin restarts by SIGHUP", t.sighup_reloads),
            ("soak: SIGHUPs with a config refused", t.sighup_refused),
            ("soak: HTTP scrapes answered", t.scrapes_ok),
            ("soak: HTTP scrapes failed", t.scrapes_failed),
        ];
        for (label, count) in counted {
            report.value(label, count as f64, "");
        }
        report.latency(
            "soak: recovery seen after its earliest time",
            &t.recovery_after_earliest,
        );
        if let (Some(first), Some(last)) = (first, last) {
            report.value("soak: RSS at start", first.rss_kib as f64 / 1024.0, "MiB");
            report.value("soak: RSS at end", last.rss_kib as f64 / 1024.0, "MiB");
            report.value("soak: threads at start", first.threads as f64, "");
            report.value("soak: threads at end", last.threads as f64, "");
            report.value("soak: open fds at start", first.fds as f64, "");
            report.value("soak: open fds at end", last.fds as f64, "");
            report.value(
                "soak: checkpoint at end",
                last.checkpoint_bytes as f64,
                "bytes",
            );
            report.value("soak: sampled to", last.at.as_secs_f64(), "s");
        }
        report.value(
            "soak: RSS, largest sample",
            max(|s| s.rss_kib) as f64 / 1024.0,
            "MiB",
        );
        report.value("soak: threads, most", max(|s| s.threads) as f64, "");
        report.value("soak: open fds, most", max(|s| s.fds) as f64, "");
        report.value(
            "soak: checkpoint, largest",
            max(|s| s.checkpoint_bytes) as f64,
            "bytes",
        );
        let fresh = firsts.iter().map(|s| s.rss_kib).max().unwrap_or(0);
        report.value(
            "soak: RSS of a freshly started plugin, largest",
            fresh as f64 / 1024.0,
            "MiB",
        );
        report.check(
            "soak: the kubelet's view equals the model",
            t.divergences.is_empty(),
            format!(
                "{} divergences{}",
                t.divergences.len(),
                t.divergences
                    .first()
                    .map_or(String::new(), |d| format!(", first: {d}"))
            ),
        );
        report.check(
            "soak: Allocate of a Healthy GPU granted",
            t.allocations_refused == 0 && t.allocations_ok > 0,
            format!(
                "{} granted, {} refused",
                t.allocations_ok, t.allocations_refused
            ),
        );
        report.check(
            "soak: every kind of event happened",
            t.faults > 0 && t.recoveries > 0 && t.harmless > 0,
            format!(
                "{} faults, {} recoveries, {} harmless",
                t.faults, t.recoveries, t.harmless
            ),
        );
    }
}

/// The driver's GPU list under `proc_root`, as the driver shows it, for the fake GPUs.
fn write_driver_gpu_list(proc_root: &Path, gpus: usize) -> anyhow::Result<()> {
    for i in 0..gpus {
        let dir = proc_root.join(format!("driver/nvidia/gpus/0000:{i:02x}:00.0"));
        std::fs::create_dir_all(&dir)?;
        std::fs::write(
            dir.join("information"),
            format!(
                "Model: \t\t NVIDIA H100 80GB HBM3\nGPU UUID: \t {}\nBus Location: \t 0000:{i:02x}:00.0\nDevice Minor: \t {i}\n",
                uuid(i)
            ),
        )?;
    }
    Ok(())
}
