//! The device model every other module shares: the devices the plugin advertises and their health
//! ([`Inventory`]), MIG devices, the IDs the kubelet sees ([`naming`]), which resources list which devices
//! ([`resources`]), the pure Allocate decisions ([`allocation`]) and what the driver says about each device
//! for a DRA ResourceSlice ([`facts`]).
//!
//! State flows one way: source (`crate::sources`) → `mpsc` of events → the health monitor (`crate::monitor`)
//! → `watch` of [`Inventory`] → gRPC streams. A slow reader of the `watch` sees the latest inventory, never a
//! backlog.

pub mod allocation;
pub mod facts;
pub mod mig;
pub mod naming;
pub mod resources;
pub mod selection;
pub mod sharing;

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::watch;

/// What the plugin knows about one device apart from its health; fixed for as long as the device is present.
///
/// A device is what the kubelet allocates: a whole GPU, or one MIG device of a GPU in MIG mode. A MIG device
/// names its GPU (`mig.parent`), which is how a fault on the GPU reaches every MIG device of it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
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
    /// The device's index as NVIDIA's plugin names it with `deviceIDStrategy: index`: `3` for GPU 3, `3:1`
    /// for MIG device 1 of GPU 3. `None` where the source has no such index; the list position stands in.
    pub index: Option<String>,
    /// Set for a MIG device: its GPU and profile.
    pub mig: Option<mig::MigInfo>,
    /// What the driver says about the device (product, memory, PCI address, versions, MIG placement), for the
    /// ResourceSlice and the status report; `None` where the source knows nothing of it. Shared, because the
    /// inventory is copied on every change and these facts never change.
    pub facts: Option<Arc<facts::DeviceFacts>>,
}

impl DeviceInfo {
    /// NVML's index of the GPU this device is (or, for a MIG device, is part of): what `nvidia-smi` shows and
    /// what an operator reads before pulling a card. It is not the position in the served list, which shifts
    /// when a GPU before it is not served. `None` where the source has no such index.
    pub fn gpu_index(&self) -> Option<usize> {
        self.index.as_deref()?.split(':').next()?.parse().ok()
    }
}

/// A device present on the node but not served to the kubelet, and why. Listed in the status report so that
/// a gap in the indices reads as what it is, not as a GPU that is not there.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Unserved {
    /// NVML's index of the GPU, where known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    /// Its UUID, where it could be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Why it is not served, in words an operator can act on.
    pub why: String,
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
    listed: u64,
}

/// Source of [`Inventory::listed_version`]: process-wide, so two inventories never share a version unless
/// one is a copy of the other with no change the kubelet can see.
static NEXT_LISTED_VERSION: AtomicU64 = AtomicU64::new(1);

impl Inventory {
    /// Builds an inventory of Healthy devices. A repeated ID keeps its first entry: two devices under one ID
    /// would make Allocate ambiguous.
    pub fn new(devices: impl IntoIterator<Item = DeviceInfo>) -> Self {
        let mut inventory = Inventory::default();
        for info in devices {
            inventory.add(info);
        }
        inventory
    }

    /// Adds a Healthy device; returns whether it was new.
    pub fn add(&mut self, info: DeviceInfo) -> bool {
        if self.index.contains_key(&info.id) {
            return false;
        }
        self.listed_changed();
        self.index.insert(info.id.clone(), self.devices.len());
        self.devices.push(DeviceState {
            info,
            health: Health::Healthy,
            reason: None,
        });
        true
    }

    /// Changes whenever what a ListAndWatch message shows changes (the set of devices, a device's health),
    /// and only then: a new reason on a device that stays Unhealthy keeps it. Equal versions mean equal
    /// lists, so a stream compares versions instead of whole lists.
    pub fn listed_version(&self) -> u64 {
        self.listed
    }

    fn listed_changed(&mut self) {
        self.listed = NEXT_LISTED_VERSION.fetch_add(1, Ordering::Relaxed);
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

    /// Whether [`Inventory::set_health`] with these values would change anything; lets a caller skip
    /// copying the inventory for the many events that change nothing.
    pub fn would_change(&self, id: &str, health: Health, reason: Option<&str>) -> bool {
        let reason = match health {
            Health::Healthy => None,
            Health::Unhealthy => reason,
        };
        self.get(id)
            .is_some_and(|d| d.health != health || d.reason.as_deref() != reason)
    }

    /// Sets a device's health and reason (the reason is dropped while Healthy); returns whether anything
    /// changed. A device that is not present is ignored.
    pub fn set_health(&mut self, id: &str, health: Health, reason: Option<String>) -> bool {
        if !self.would_change(id, health, reason.as_deref()) {
            return false;
        }
        let Some(&i) = self.index.get(id) else {
            return false;
        };
        let reason = match health {
            Health::Healthy => None,
            Health::Unhealthy => reason,
        };
        if self.devices[i].health != health {
            self.listed_changed();
        }
        let device = &mut self.devices[i];
        device.health = health;
        device.reason = reason;
        true
    }

    /// The devices `keep` selects, in the same order, with their health and reasons. The result keeps
    /// `previous`'s listed version when the kubelet would see the same list in both (same devices, same
    /// health), so that a change elsewhere in the inventory is not re-sent to this subset's streams.
    pub fn subset(
        &self,
        keep: impl Fn(&DeviceInfo) -> bool,
        previous: Option<&Inventory>,
    ) -> Inventory {
        let mut subset = Inventory::default();
        for device in self.devices.iter().filter(|d| keep(&d.info)) {
            subset
                .index
                .insert(device.info.id.clone(), subset.devices.len());
            subset.devices.push(device.clone());
        }
        let same_list = previous.is_some_and(|p| {
            p.devices.len() == subset.devices.len()
                && p.devices
                    .iter()
                    .zip(&subset.devices)
                    .all(|(a, b)| a.info == b.info && a.health == b.health)
        });
        match previous {
            Some(p) if same_list => subset.listed = p.listed,
            _ => subset.listed_changed(),
        }
        subset
    }

    /// Whether `subset` already shows what [`Inventory::subset`] with `keep` would: the same devices in the
    /// same order, with the same health and reasons. Allocates nothing: most changes are to other devices.
    pub fn same_subset(&self, keep: impl Fn(&DeviceInfo) -> bool, subset: &Inventory) -> bool {
        let mut theirs = subset.devices.iter();
        for device in self.devices.iter().filter(|d| keep(&d.info)) {
            match theirs.next() {
                Some(other)
                    if other.info.id == device.info.id
                        && other.health == device.health
                        && other.reason == device.reason => {}
                _ => return false,
            }
        }
        theirs.next().is_none()
    }

    /// Removes a device; returns whether it was present.
    pub fn remove(&mut self, id: &str) -> bool {
        let Some(i) = self.index.remove(id) else {
            return false;
        };
        self.listed_changed();
        self.devices.remove(i);
        for slot in self.index.values_mut() {
            if *slot > i {
                *slot -= 1;
            }
        }
        true
    }
}

/// Shared, cheaply cloned view of the current inventory.
pub type InventoryWatch = watch::Receiver<Arc<Inventory>>;

/// A view of `inventory` holding only the devices `keep` selects (one resource's, when the plugin serves
/// several), kept current by a task of its own until `inventory`'s sender is gone. A change to other devices
/// leaves the view as it is, unless it changes a reason, which the view then carries without a new version.
pub fn subset_watch(
    mut inventory: InventoryWatch,
    keep: impl Fn(&DeviceInfo) -> bool + Send + 'static,
) -> InventoryWatch {
    let first = Arc::new(inventory.borrow_and_update().subset(&keep, None));
    let (tx, rx) = watch::channel(first);
    tokio::spawn(async move {
        while inventory.changed().await.is_ok() {
            let whole = inventory.borrow_and_update().clone();
            tx.send_if_modified(|current| {
                if whole.same_subset(&keep, current) {
                    return false;
                }
                *current = Arc::new(whole.subset(&keep, Some(current)));
                true
            });
            if tx.is_closed() {
                return;
            }
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(id: &str) -> DeviceInfo {
        DeviceInfo {
            id: id.to_string(),
            ..DeviceInfo::default()
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
    fn the_listed_version_moves_only_with_what_the_kubelet_sees() {
        let mut inv = Inventory::new([gpu("a"), gpu("b")]);
        let copy = inv.clone();
        assert_eq!(copy.listed_version(), inv.listed_version());
        let mut seen = vec![inv.listed_version()];
        inv.set_health("a", Health::Unhealthy, Some("XID 79".into()));
        seen.push(inv.listed_version());
        inv.set_health("a", Health::Unhealthy, Some("XID 79, then XID 48".into()));
        assert_eq!(
            inv.listed_version(),
            seen[1],
            "a new reason on an Unhealthy device is not in the list"
        );
        inv.add(gpu("c"));
        seen.push(inv.listed_version());
        inv.remove("b");
        seen.push(inv.listed_version());
        let mut unique = seen.clone();
        unique.dedup();
        assert_eq!(unique, seen, "every visible change gives a new version");
        let rebuilt = Inventory::new([gpu("a"), gpu("b")]);
        assert_ne!(
            rebuilt.listed_version(),
            copy.listed_version(),
            "an inventory built anew never passes for an older one"
        );
    }

    #[test]
    fn a_subset_keeps_its_version_until_its_own_devices_change() {
        let mut whole = Inventory::new([gpu("a"), gpu("b"), gpu("c")]);
        let keep = |info: &DeviceInfo| info.id != "b";
        let first = whole.subset(keep, None);
        assert_eq!(first.len(), 2);
        whole.set_health("b", Health::Unhealthy, Some("XID 79".into()));
        assert!(whole.same_subset(keep, &first), "b is not in the subset");
        whole.set_health("c", Health::Unhealthy, Some("XID 79".into()));
        assert!(!whole.same_subset(keep, &first));
        let second = whole.subset(keep, Some(&first));
        assert_ne!(second.listed_version(), first.listed_version());
        assert_eq!(second.get("c").map(|d| d.health), Some(Health::Unhealthy));
        whole.set_health("c", Health::Unhealthy, Some("XID 79, then XID 48".into()));
        assert!(!whole.same_subset(keep, &second), "a new reason is carried");
        let third = whole.subset(keep, Some(&second));
        assert_eq!(
            third.listed_version(),
            second.listed_version(),
            "a new reason alone is not re-sent"
        );
    }

    #[test]
    fn health_for_an_unknown_device_changes_nothing() {
        let mut inv = Inventory::new([gpu("a")]);
        assert!(!inv.set_health("zzz", Health::Unhealthy, None));
        assert_eq!(inv.devices()[0].health, Health::Healthy);
    }

    #[test]
    fn removing_a_device_keeps_lookup_of_the_others_right() {
        let mut inv = Inventory::new([gpu("a"), gpu("b"), gpu("c")]);
        assert!(inv.remove("a"));
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
}
