//! How devices are named to the kubelet, as NVIDIA's plugin names them: by GPU UUID or by index
//! (`deviceIDStrategy`), and, with time-slicing, as `replicas` devices per GPU, `<id>::<n>` for n in
//! 0..replicas (for every device of the resource, or for some of them where only those are shared). Health, the checkpoint and the Events stay per physical GPU: a name is only how the kubelet
//! sees a GPU, so a fault on a GPU is on every one of its replicas in the same list.

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::devices::{DeviceState, Inventory};

/// What a device ID given to the kubelet is built from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum IdStrategy {
    /// The GPU UUID.
    #[default]
    Uuid,
    /// The device's index as NVIDIA's plugin gives it: the GPU's NVML index, `<gpu>:<n>` for a MIG device
    /// (its position in the device list where the source knows no index).
    Index,
}

/// The naming in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Naming {
    /// UUIDs or indices.
    pub ids: IdStrategy,
    /// Devices listed per GPU; 1 without sharing.
    pub replicas: usize,
    /// Where only some of the resource's devices are shared: their inventory IDs (the others are listed once,
    /// under their own ID). `None`: every device has `replicas`.
    pub replicated: Option<Arc<BTreeSet<String>>>,
    /// Refuse a container asking for more than one replica (NVIDIA's `failRequestsGreaterThanOne`).
    pub fail_requests_greater_than_one: bool,
}

impl Default for Naming {
    fn default() -> Self {
        Naming {
            ids: IdStrategy::Uuid,
            replicas: 1,
            replicated: None,
            fail_requests_greater_than_one: false,
        }
    }
}

/// Separates a GPU's ID from its replica number, as NVIDIA's plugin writes it.
const REPLICA_SEPARATOR: &str = "::";

impl Naming {
    /// Whether the kubelet sees the inventory's own IDs, one per GPU.
    pub fn is_plain(&self) -> bool {
        self.ids == IdStrategy::Uuid && self.replicas <= 1
    }

    fn base(&self, position: usize, device: &DeviceState) -> String {
        match self.ids {
            IdStrategy::Uuid => device.info.id.clone(),
            IdStrategy::Index => device
                .info
                .index
                .clone()
                .unwrap_or_else(|| position.to_string()),
        }
    }

    /// How many devices the kubelet sees of the device with inventory ID `id`.
    fn replicas_of(&self, id: &str) -> usize {
        match &self.replicated {
            Some(shared) if !shared.contains(id) => 1,
            _ => self.replicas.max(1),
        }
    }

    /// Whether a kubelet ID names a replica (`<id>::<n>`) rather than a whole device.
    pub fn is_replica(kubelet_id: &str) -> bool {
        kubelet_id.contains(REPLICA_SEPARATOR)
    }

    /// The kubelet's IDs of one device from its base ID: the base itself, or one per replica.
    fn ids_from(base: String, replicas: usize) -> impl Iterator<Item = String> {
        (0..replicas).map(move |n| {
            if replicas == 1 {
                base.clone()
            } else {
                format!("{base}{REPLICA_SEPARATOR}{n}")
            }
        })
    }

    /// The kubelet's IDs for every device, in list order, each with its device: one per replica.
    pub fn listed<'a>(
        &'a self,
        inventory: &'a Inventory,
    ) -> impl Iterator<Item = (String, &'a DeviceState)> + 'a {
        inventory
            .devices()
            .iter()
            .enumerate()
            .flat_map(move |(position, device)| {
                Self::ids_from(
                    self.base(position, device),
                    self.replicas_of(&device.info.id),
                )
                .map(move |id| (id, device))
            })
    }

    /// The inventory ID of the device a kubelet ID names, if it names one: a replica of a shared device, or
    /// a device that is not shared by its own ID.
    pub fn resolve<'a>(&self, inventory: &'a Inventory, kubelet_id: &str) -> Option<&'a str> {
        let (base, replica) = match kubelet_id.split_once(REPLICA_SEPARATOR) {
            Some((base, n)) => {
                let number: usize = n.parse().ok()?;
                // One spelling per replica: no sign, no leading zeros.
                if number.to_string() != n {
                    return None;
                }
                (base, Some(number))
            }
            None => (kubelet_id, None),
        };
        let device = match self.ids {
            IdStrategy::Uuid => inventory.get(base)?,
            IdStrategy::Index => {
                inventory
                    .devices()
                    .iter()
                    .enumerate()
                    .find(|(position, device)| self.base(*position, device) == base)?
                    .1
            }
        };
        let replicas = self.replicas_of(&device.info.id);
        match replica {
            None if replicas == 1 => Some(device.info.id.as_str()),
            Some(n) if replicas > 1 && n < replicas => Some(device.info.id.as_str()),
            _ => None,
        }
    }

    /// The kubelet IDs of the device with inventory ID `id`.
    pub fn kubelet_ids_of(&self, inventory: &Inventory, id: &str) -> Vec<String> {
        let Some(position) = inventory.position(id) else {
            return Vec::new();
        };
        Self::ids_from(
            self.base(position, &inventory.devices()[position]),
            self.replicas_of(id),
        )
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::DeviceInfo;

    fn inventory() -> Inventory {
        Inventory::new((0..2).map(|i| DeviceInfo {
            id: format!("GPU-{i}"),
            numa_node: None,
            ..DeviceInfo::default()
        }))
    }

    #[test]
    fn replicas_are_listed_per_gpu_and_resolve_back() {
        let inv = inventory();
        let naming = Naming {
            replicas: 3,
            ..Naming::default()
        };
        let ids: Vec<String> = naming.listed(&inv).map(|(id, _)| id).collect();
        assert_eq!(
            ids,
            [
                "GPU-0::0", "GPU-0::1", "GPU-0::2", "GPU-1::0", "GPU-1::1", "GPU-1::2"
            ]
        );
        assert_eq!(naming.resolve(&inv, "GPU-1::2"), Some("GPU-1"));
        for bad in [
            "GPU-1",
            "GPU-1::3",
            "GPU-1::01",
            "GPU-1::-1",
            "GPU-9::0",
            "GPU-1::x",
        ] {
            assert_eq!(naming.resolve(&inv, bad), None, "{bad}");
        }
        assert_eq!(
            naming.kubelet_ids_of(&inv, "GPU-0"),
            ["GPU-0::0", "GPU-0::1", "GPU-0::2"]
        );
    }

    #[test]
    fn where_only_some_devices_are_shared_the_others_keep_their_own_id() {
        let inv = inventory();
        let naming = Naming {
            replicas: 2,
            replicated: Some(Arc::new(BTreeSet::from(["GPU-1".to_string()]))),
            ..Naming::default()
        };
        let ids: Vec<String> = naming.listed(&inv).map(|(id, _)| id).collect();
        assert_eq!(ids, ["GPU-0", "GPU-1::0", "GPU-1::1"]);
        assert_eq!(naming.resolve(&inv, "GPU-0"), Some("GPU-0"));
        assert_eq!(naming.resolve(&inv, "GPU-1::1"), Some("GPU-1"));
        for bad in ["GPU-0::0", "GPU-1", "GPU-1::2"] {
            assert_eq!(naming.resolve(&inv, bad), None, "{bad}");
        }
        assert_eq!(naming.kubelet_ids_of(&inv, "GPU-0"), ["GPU-0"]);
        assert!(Naming::is_replica("GPU-1::1") && !Naming::is_replica("3:1"));
    }

    #[test]
    fn index_ids_name_the_position() {
        let inv = inventory();
        let naming = Naming {
            ids: IdStrategy::Index,
            ..Naming::default()
        };
        let ids: Vec<String> = naming.listed(&inv).map(|(id, _)| id).collect();
        assert_eq!(ids, ["0", "1"]);
        let mig = Inventory::new((0..2).map(|i| DeviceInfo {
            id: format!("MIG-{i}"),
            index: Some(format!("3:{i}")),
            ..DeviceInfo::default()
        }));
        let ids: Vec<String> = naming.listed(&mig).map(|(id, _)| id).collect();
        assert_eq!(ids, ["3:0", "3:1"], "a MIG device is <gpu>:<n>");
        assert_eq!(naming.resolve(&mig, "3:1"), Some("MIG-1"));
        assert_eq!(naming.resolve(&mig, "0"), None);
        assert_eq!(naming.resolve(&inv, "1"), Some("GPU-1"));
        for bad in ["2", "01", "GPU-1", "-1", ""] {
            assert_eq!(naming.resolve(&inv, bad), None, "{bad:?}");
        }
        let both = Naming {
            ids: IdStrategy::Index,
            replicas: 2,
            ..Naming::default()
        };
        assert_eq!(both.resolve(&inv, "0::1"), Some("GPU-0"));
        assert!(Naming::default().is_plain() && !both.is_plain());
    }
}
