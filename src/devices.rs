//! The devices the plugin advertises and their health: the model every other module shares, the
//! [`DeviceSource`] trait a GPU backend implements, and the task that folds a source's events into the
//! `watch` channel every ListAndWatch stream reads.
//!
//! State flows one way: source → `mpsc` of [`DeviceEvent`] → [`run_inventory`] → `watch` of [`Inventory`] →
//! gRPC streams. A slow reader of the `watch` sees the latest inventory, never a backlog.

pub mod script;
pub mod simulated;

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use tokio::sync::{mpsc, watch};

use crate::health::{HealthEngine, Observation};

/// What the plugin knows about one device apart from its health; fixed for as long as the device is present.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The ID the kubelet sees and Allocate receives; for GPUs, the GPU UUID (as NVIDIA's plugin does, so
    /// existing tooling that reads `NVIDIA_VISIBLE_DEVICES` keeps working).
    pub id: String,
    /// NUMA node the device is attached to, when the source knows it. Sent as the device topology, which the
    /// kubelet's topology manager uses, and used to keep a multi-GPU allocation on one node.
    pub numa_node: Option<i64>,
    /// Device nodes a container needs for this device, as absolute paths in the container (e.g.
    /// `/dev/nvidia0`). Handed out as device specs when that is enabled and the node exists under the dev root.
    pub device_nodes: Vec<PathBuf>,
}

/// Health as the kubelet understands it: only Healthy devices are allocatable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Health {
    /// Fit for new pods.
    Healthy,
    /// Keep new pods away; the device stays in capacity so operators still see it.
    Unhealthy,
}

impl Health {
    /// The string the v1beta1 API carries in `Device.health`.
    pub fn as_api_str(self) -> &'static str {
        match self {
            Health::Healthy => "Healthy",
            Health::Unhealthy => "Unhealthy",
        }
    }
}

impl fmt::Display for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_api_str())
    }
}

/// One device with its current health.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceState {
    /// Identity and topology.
    pub info: DeviceInfo,
    /// Current health.
    pub health: Health,
    /// Why the device is Unhealthy, in words an operator can act on; `None` while Healthy. Allocate quotes it
    /// when it refuses the device.
    pub reason: Option<String>,
}

/// The complete device list at one moment, in a stable order (the order the source reported the devices).
///
/// Every ListAndWatch message is built from one `Inventory`, and the kubelet takes each message as the whole
/// truth, so an `Inventory` is always complete, never a delta.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inventory {
    devices: Vec<DeviceState>,
    index: HashMap<String, usize>,
}

impl Inventory {
    /// Builds an inventory of Healthy devices. A repeated ID keeps its first entry: two devices under one ID
    /// would make Allocate ambiguous.
    pub fn new(devices: impl IntoIterator<Item = DeviceInfo>) -> Self {
        let mut inventory = Inventory::default();
        for info in devices {
            inventory.insert(info);
        }
        inventory
    }

    fn insert(&mut self, info: DeviceInfo) -> bool {
        if self.index.contains_key(&info.id) {
            return false;
        }
        self.index.insert(info.id.clone(), self.devices.len());
        self.devices.push(DeviceState {
            info,
            health: Health::Healthy,
            reason: None,
        });
        true
    }

    /// All devices, in stable order.
    pub fn devices(&self) -> &[DeviceState] {
        &self.devices
    }

    /// The device with this ID, if present.
    pub fn get(&self, id: &str) -> Option<&DeviceState> {
        self.index.get(id).map(|&i| &self.devices[i])
    }

    /// Position of the device in the stable order, used to keep preferred allocations deterministic.
    pub fn position(&self, id: &str) -> Option<usize> {
        self.index.get(id).copied()
    }

    /// Number of devices.
    pub fn len(&self) -> usize {
        self.devices.len()
    }

    /// Whether there are no devices.
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// Sets a device's health and reason (the reason is dropped while Healthy); returns whether anything
    /// changed. A device that is not present is ignored.
    pub fn set_health(&mut self, id: &str, health: Health, reason: Option<String>) -> bool {
        let Some(&i) = self.index.get(id) else {
            return false;
        };
        let device = &mut self.devices[i];
        let reason = match health {
            Health::Healthy => None,
            Health::Unhealthy => reason,
        };
        if device.health == health && device.reason == reason {
            return false;
        }
        device.health = health;
        device.reason = reason;
        true
    }

    /// Adds or removes a device; returns whether the set changed. Health events go through
    /// [`Inventory::set_health`] after the health engine has judged them.
    pub fn apply(&mut self, event: DeviceEvent) -> bool {
        match event {
            DeviceEvent::Observed { .. } => false,
            DeviceEvent::Added(info) => {
                let id = info.id.clone();
                let added = self.insert(info);
                if added {
                    tracing::info!(device = %id, "device added");
                }
                added
            }
            DeviceEvent::Removed(id) => {
                let Some(i) = self.index.remove(&id) else {
                    return false;
                };
                self.devices.remove(i);
                for slot in self.index.values_mut() {
                    if *slot > i {
                        *slot -= 1;
                    }
                }
                tracing::info!(device = %id, "device removed");
                true
            }
        }
    }
}

/// A change reported by a device source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceEvent {
    /// The backend saw something on a device; the health engine decides what it means.
    Observed {
        /// Device ID.
        id: String,
        /// What was seen.
        observation: Observation,
        /// When it was seen.
        at: SystemTime,
    },
    /// A device appeared.
    Added(DeviceInfo),
    /// A device is gone.
    Removed(String),
}

/// Error from a device source.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The source could not enumerate its devices.
    #[error("cannot discover devices: {0}")]
    Discovery(String),
}

/// Where devices and their health come from: NVML on a GPU node, simulated GPUs elsewhere.
pub trait DeviceSource: Send + 'static {
    /// The devices present now, in a stable order.
    fn discover(&mut self) -> Result<Vec<DeviceInfo>, SourceError>;

    /// Starts reporting changes into `events`. The source stops when `events` is closed or its own resources
    /// are dropped; it must not block the caller.
    fn start(self: Box<Self>, events: mpsc::Sender<DeviceEvent>) -> Result<(), SourceError>;
}

/// Shared, cheaply cloned view of the current inventory.
pub type InventoryWatch = watch::Receiver<Arc<Inventory>>;

/// Discovers the source's devices, starts it, and spawns the task that keeps the returned watch current.
/// Must be called inside a tokio runtime.
pub fn spawn_inventory(mut source: Box<dyn DeviceSource>) -> Result<InventoryWatch, SourceError> {
    let found = source.discover()?;
    tracing::info!(devices = found.len(), "discovered devices");
    let (tx, rx) = watch::channel(Arc::new(Inventory::new(found)));
    // Bounded: a source that outruns the inventory task waits rather than growing memory.
    let (event_tx, event_rx) = mpsc::channel(1024);
    source.start(event_tx)?;
    tokio::spawn(run_inventory(event_rx, tx));
    Ok(rx)
}

/// Folds `events` into the inventory published on `tx` until the event channel closes, judging observations
/// with the health engine. Every health transition is one structured log event. A burst of events publishes
/// once per event that changed something; readers of the watch coalesce to the latest.
pub async fn run_inventory(
    mut events: mpsc::Receiver<DeviceEvent>,
    tx: watch::Sender<Arc<Inventory>>,
) {
    let mut engine = HealthEngine::new();
    while let Some(event) = events.recv().await {
        tx.send_if_modified(|current| {
            // Clone-on-write: readers hold the old Arc until they look again.
            let mut next = Inventory::clone(current);
            if apply_event(&mut engine, &mut next, event) {
                *current = Arc::new(next);
                true
            } else {
                false
            }
        });
    }
}

fn apply_event(engine: &mut HealthEngine, inventory: &mut Inventory, event: DeviceEvent) -> bool {
    match event {
        DeviceEvent::Observed {
            id,
            observation,
            at,
        } => {
            if inventory.get(&id).is_none() {
                tracing::warn!(device = %id, ?observation, "event for a device that is not present; ignored");
                return false;
            }
            let outcome = engine.observe(&id, &observation, at);
            if outcome.is_transition() {
                tracing::info!(
                    device = %id,
                    old = %outcome.old,
                    new = %outcome.new,
                    condition = %outcome.condition,
                    reason = outcome.reason.as_deref().unwrap_or(""),
                    "device health changed"
                );
            } else {
                tracing::debug!(device = %id, health = %outcome.new, condition = %outcome.condition, "condition recorded");
            }
            inventory.set_health(&id, outcome.new, outcome.reason)
        }
        DeviceEvent::Removed(id) => {
            engine.remove(&id);
            inventory.apply(DeviceEvent::Removed(id))
        }
        added => inventory.apply(added),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(id: &str) -> DeviceInfo {
        DeviceInfo {
            id: id.to_string(),
            numa_node: None,
            device_nodes: vec![],
        }
    }

    fn observed(id: &str, observation: Observation) -> DeviceEvent {
        DeviceEvent::Observed {
            id: id.into(),
            observation,
            at: SystemTime::UNIX_EPOCH,
        }
    }

    #[test]
    fn set_health_marks_the_device_and_keeps_the_reason() {
        let mut inv = Inventory::new([gpu("a"), gpu("b")]);
        assert!(inv.set_health("b", Health::Unhealthy, Some("XID 79".into())));
        let b = inv.get("b").map(|d| (d.health, d.reason.clone()));
        assert_eq!(b, Some((Health::Unhealthy, Some("XID 79".into()))));
        assert_eq!(inv.get("a").map(|d| d.health), Some(Health::Healthy));
        assert!(
            !inv.set_health("b", Health::Unhealthy, Some("XID 79".into())),
            "same state is no change"
        );
        assert!(inv.set_health("b", Health::Healthy, Some("ignored".into())));
        assert_eq!(inv.get("b").and_then(|d| d.reason.clone()), None);
    }

    #[test]
    fn health_for_an_unknown_device_changes_nothing() {
        let mut inv = Inventory::new([gpu("a")]);
        assert!(!inv.set_health("zzz", Health::Unhealthy, None));
        let mut engine = HealthEngine::new();
        assert!(!apply_event(
            &mut engine,
            &mut inv,
            observed("zzz", Observation::Xid(79))
        ));
        assert_eq!(inv.devices()[0].health, Health::Healthy);
    }

    #[test]
    fn removing_a_device_keeps_lookup_of_the_others_right() {
        let mut inv = Inventory::new([gpu("a"), gpu("b"), gpu("c")]);
        assert!(inv.apply(DeviceEvent::Removed("a".into())));
        assert_eq!(inv.get("c").map(|d| d.info.id.as_str()), Some("c"));
        assert_eq!(inv.position("c"), Some(1));
        assert!(inv.get("a").is_none());
    }

    #[test]
    fn duplicate_ids_keep_the_first_device() {
        let mut second = gpu("a");
        second.numa_node = Some(1);
        let inv = Inventory::new([gpu("a"), second]);
        assert_eq!(inv.len(), 1);
        assert_eq!(inv.devices()[0].info.numa_node, None);
    }

    #[tokio::test]
    async fn inventory_task_publishes_each_change() {
        let (etx, erx) = mpsc::channel(8);
        let (wtx, mut wrx) = watch::channel(Arc::new(Inventory::new([gpu("a")])));
        tokio::spawn(run_inventory(erx, wtx));
        // A harmless XID is recorded without a new list; a fatal one publishes Unhealthy with the reason.
        etx.send(observed("a", Observation::Xid(13))).await.ok();
        etx.send(observed("a", Observation::Xid(79))).await.ok();
        wrx.changed().await.ok();
        let device = wrx.borrow().devices()[0].clone();
        assert_eq!(device.health, Health::Unhealthy);
        assert!(device.reason.is_some_and(|r| r.starts_with("XID 79")));
    }
}
