//! How devices are named to the kubelet, as NVIDIA's plugin names them: by GPU UUID or by index
//! (`deviceIDStrategy`), and, with time-slicing, as `replicas` devices per GPU, `<id>::<n>` for n in
//! 0..replicas. Health, the checkpoint and the Events stay per physical GPU: a name is only how the kubelet
//! sees a GPU, so a fault on a GPU is on every one of its replicas in the same list.

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
    /// Refuse a container asking for more than one replica (NVIDIA's `failRequestsGreaterThanOne`).
    pub fail_requests_greater_than_one: bool,
}

impl Default for Naming {
    fn default() -> Self {
        Naming {
            ids: IdStrategy::Uuid,
            replicas: 1,
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

    /// The kubelet's IDs of one GPU from its base ID: the base itself, or one per replica.
    fn ids_from(&self, base: String) -> impl Iterator<Item = String> {
        let replicas = self.replicas.max(1);
        (0..replicas).map(move |n| {
            if replicas == 1 {
                base.clone()
            } else {
                format!("{base}{REPLICA_SEPARATOR}{n}")
            }
        })
    }

    /// The kubelet's IDs for every device, in list order, each with its device: `replicas` per device.
    pub fn listed<'a>(
        &'a self,
        inventory: &'a Inventory,
    ) -> impl Iterator<Item = (String, &'a DeviceState)> + 'a {
        inventory
            .devices()
            .iter()
            .enumerate()
            .flat_map(move |(position, device)| {
                self.ids_from(self.base(position, device))
                    .map(move |id| (id, device))
            })
    }

    /// The inventory ID of the GPU a kubelet ID names, if it names one.
    pub fn resolve<'a>(&self, inventory: &'a Inventory, kubelet_id: &str) -> Option<&'a str> {
        let base = if self.replicas > 1 {
            let (base, n) = kubelet_id.split_once(REPLICA_SEPARATOR)?;
            let n: usize = n.parse().ok()?;
            if n >= self.replicas || n.to_string() != kubelet_id[base.len() + 2..] {
                return None;
            }
            base
        } else {
            kubelet_id
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
        Some(device.info.id.as_str())
    }

    /// The kubelet IDs of the GPU with inventory ID `id`.
    pub fn kubelet_ids_of(&self, inventory: &Inventory, id: &str) -> Vec<String> {
        let Some(position) = inventory.position(id) else {
            return Vec::new();
        };
        self.ids_from(self.base(position, &inventory.devices()[position]))
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
