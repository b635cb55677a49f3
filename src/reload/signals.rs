//! The process's signals: SIGTERM and SIGINT stop it, SIGHUP reloads its config (checked in a process of its
//! own, then weighed by the [`Gate`] once the plugin serves).

use std::sync::Arc;

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;

use super::Gate;
use super::handover;
use crate::config;

/// Whether a SIGHUP's reload was admitted: set once, with the watcher's process ID where one covers the
/// restart.
pub type ReloadAsked = Arc<std::sync::OnceLock<Option<u32>>>;

/// What the running plugin weighs before a reload, once it serves (see [`Gate`]).
pub type GateSlot = Arc<std::sync::OnceLock<Gate>>;

/// SIGTERM (the kubelet stopping the pod) and SIGINT (Ctrl-C) both start a clean shutdown. SIGHUP (config
/// reloaders) reads the config again: one that does not load is refused with one error line and the plugin
/// goes on as it is; one that loads stops the plugin cleanly and the returned flag says to start it again.
///
/// The new config is read and checked in a process of its own at a lower priority (see
/// [`config::reload`]), never on this runtime, which carries faults to the kubelet: a huge or pathological
/// file costs that process alone, which is refused and killed past [`RELOAD_CHECK_LIMIT`], and SIGTERM is
/// answered meanwhile. One check runs at a time; a SIGHUP during one is said and ignored.
///
/// Once the plugin serves, a config that loads is also weighed by the [`Gate`]: a change of `dra`
/// that would put a GPU in use on both roads is refused, and the restart waits for a watcher that covers it,
/// so that no fault is lost meanwhile.
pub fn spawn(shutdown: CancellationToken, gate: GateSlot) -> anyhow::Result<ReloadAsked> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("cannot install the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("cannot install the SIGINT handler")?;
    let mut hup = signal(SignalKind::hangup()).context("cannot install the SIGHUP handler")?;
    let reload: ReloadAsked = Arc::default();
    let reloading = reload.clone();
    tokio::spawn(async move {
        // The check of the config a SIGHUP asked for, while one runs: never more than one at a time.
        let mut checking: Option<ConfigCheck> = None;
        loop {
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
                _ = hup.recv() => {
                    if checking.is_some() {
                        tracing::warn!(signal = "SIGHUP", "the config of an earlier SIGHUP is still being read; this one is ignored");
                        continue;
                    }
                    checking = Some(Box::pin(checked_reload(gate.clone())));
                    continue;
                }
                outcome = config_checked(&mut checking) => {
                    checking = None;
                    match outcome {
                        Ok(watcher) => {
                            tracing::info!(signal = "SIGHUP", "config loads; restarting with it");
                            let _set = reloading.set(watcher);
                            shutdown.cancel();
                            return;
                        }
                        Err(e) => tracing::error!(signal = "SIGHUP", "new config refused, the running one is kept: {e}"),
                    }
                    continue;
                }
            };
            tracing::info!(signal = name, "shutting down");
            shutdown.cancel();
            return;
        }
    });
    Ok(reload)
}

/// A SIGHUP's reload from start to decision: the config checked in a process of its own, then, once the
/// plugin serves, weighed by the gate. `Ok` carries the watcher's process ID, where one was started.
async fn checked_reload(gate: GateSlot) -> Result<Option<u32>, String> {
    let said = config::reload::check_in_child(reload_check(), RELOAD_CHECK_LIMIT).await?;
    let Some(gate) = gate.get() else {
        // Not serving yet (NVML still loading): nothing is handed out, nor watched, to carry over.
        return Ok(None);
    };
    let new = config::reload::new_roads(&said)?;
    gate.admit(new).await.map(Some)
}

/// The watcher that covers a restart in place: this binary as [`handover::SUBCOMMAND`] with this process's
/// arguments (its environment is inherited).
pub fn handover_watcher() -> std::process::Command {
    let mut command = std::process::Command::new("/proc/self/exe");
    command
        .arg(handover::SUBCOMMAND)
        .args(std::env::args_os().skip(1));
    command
}

/// How long reading and checking the config after a SIGHUP may take before it is refused and its process
/// killed.
const RELOAD_CHECK_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

/// This process's own binary, run as `reload-check` with this process's arguments (its environment is
/// inherited): the same settings a restart would read.
fn reload_check() -> tokio::process::Command {
    let mut command = tokio::process::Command::new("/proc/self/exe");
    command
        .arg(config::reload::SUBCOMMAND)
        .args(std::env::args_os().skip(1));
    command
}

/// A reload's check in progress: the watcher to take over from when the config is admitted, or why not in
/// one line.
type ConfigCheck = std::pin::Pin<Box<dyn Future<Output = Result<Option<u32>, String>> + Send>>;

/// The outcome of the config check in progress; pending while there is none.
async fn config_checked(checking: &mut Option<ConfigCheck>) -> Result<Option<u32>, String> {
    match checking {
        Some(check) => check.await,
        None => std::future::pending().await,
    }
}
