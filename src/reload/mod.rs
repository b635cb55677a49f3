//! A SIGHUP's reload: the new config's change of roads checked against what is in use
//! ([`crate::roads::switch`]), and the
//! GPUs watched across the restart in place ([`handover`]). The config itself is read and checked in a
//! process of its own ([`crate::config::reload`]).

pub mod handover;
pub mod signals;

use std::sync::Arc;
use std::time::Duration;

use crate::devices::selection::DraSelection;
use crate::devices::{InventoryWatch, Unserved};
use crate::dra::registration::DraStatus;
use crate::kubelet::pods::PodResources;

/// How long the watcher may take to load the device source and register its event sets: NVML's load
/// limit, and some.
const WATCHER_READY_LIMIT: Duration = Duration::from_secs(70);

/// What a running plugin weighs before it restarts with a new config: what each road holds now, and how to
/// start the watcher that covers the restart.
pub struct Gate {
    /// Every device the node serves, on either road.
    pub inventory: InventoryWatch,
    /// Devices found but not served (a selection may name one).
    pub unserved: Vec<Unserved>,
    /// The running config's DRA selection.
    pub dra: Option<DraSelection>,
    /// The DRA side's status: the prepared devices and their claims.
    pub claims: Option<tokio::sync::watch::Receiver<DraStatus>>,
    /// The kubelet's pod-resources client: which containers hold the device plugin's devices.
    pub pods: Option<Arc<PodResources>>,
    /// The watcher's command line: this binary as [`handover::SUBCOMMAND`] with the plugin's arguments.
    pub watcher: fn() -> std::process::Command,
}

/// Runs this program again in this process (same PID, arguments and environment), which reads the config
/// anew; health state carries over in the checkpoint, flushed at shutdown, and what the driver reported
/// since the old image stopped watching comes from `watcher` (see [`handover`]). Returns only when the
/// program cannot be run again, with why.
pub fn restart_in_place(watcher: Option<u32>) -> std::io::Error {
    use std::os::unix::process::CommandExt as _;
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return e,
    };
    let mut again = std::process::Command::new(exe);
    again.args(std::env::args_os().skip(1));
    match watcher {
        Some(pid) => again.env(handover::PID_VAR, pid.to_string()),
        // One an earlier reload named is long gone.
        None => again.env_remove(handover::PID_VAR),
    };
    again.exec()
}

impl Gate {
    /// Whether the plugin may restart with a config whose DRA selection is `new`: the roads' change checked
    /// against what is in use, then the watcher started. `Ok` carries the watcher's process ID, for the
    /// restarted image; `Err` says why the running config is kept.
    pub async fn admit(&self, new: Option<DraSelection>) -> Result<u32, String> {
        if new != self.dra {
            let claims = self
                .claims
                .as_ref()
                .map(|c| c.borrow().prepared.clone())
                .unwrap_or_default();
            let holders = match &self.pods {
                Some(pods) => pods
                    .holders(Duration::ZERO)
                    .await
                    .ok_or("the kubelet's pod-resources API does not answer"),
                None => Err("the pod-resources API is off (--pod-resources-socket)"),
            };
            let inventory = self.inventory.borrow().clone();
            crate::roads::switch::check_switch(
                &inventory,
                &self.unserved,
                self.dra.as_ref(),
                new.as_ref(),
                crate::roads::switch::InUse {
                    claims: &claims,
                    pods: holders.as_ref().map_err(|why| *why),
                },
            )?;
        }
        handover::start_watcher((self.watcher)(), WATCHER_READY_LIMIT).await
    }
}
