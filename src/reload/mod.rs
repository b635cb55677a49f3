//! A SIGHUP's reload: the new config's change of roads checked against what is in use ([`roads`]), and the
//! GPUs watched across the restart in place ([`handover`]). The config itself is read and checked in a
//! process of its own ([`crate::config::reload`]).

pub mod handover;
pub mod roads;

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
            roads::check_switch(
                &inventory,
                &self.unserved,
                self.dra.as_ref(),
                new.as_ref(),
                roads::InUse {
                    claims: &claims,
                    pods: holders.as_ref().map_err(|why| *why),
                },
            )?;
        }
        handover::start_watcher((self.watcher)(), WATCHER_READY_LIMIT).await
    }
}
