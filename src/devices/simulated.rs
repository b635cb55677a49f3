//! Simulated GPUs: a device source that needs no hardware, so the plugin can be tried and tested anywhere.
//! A [`SimulatedControl`] changes health or the device set from outside, as a GPU fault would.

use std::path::PathBuf;

use tokio::sync::mpsc;

use super::{DeviceEvent, DeviceInfo, DeviceSource, Health, SourceError};

/// Devices per simulated NUMA node, so that simulated nodes exercise NUMA-aware preferred allocation the way a
/// dual-socket GPU server does (four GPUs on each socket).
const GPUS_PER_NUMA_NODE: usize = 4;

/// A fixed set of simulated GPUs with deterministic UUIDs.
pub struct SimulatedGpus {
    devices: Vec<DeviceInfo>,
    control: mpsc::Receiver<DeviceEvent>,
}

/// Injects faults and recoveries into a running [`SimulatedGpus`] source.
#[derive(Clone)]
pub struct SimulatedControl {
    tx: mpsc::Sender<DeviceEvent>,
}

impl SimulatedGpus {
    /// `count` GPUs: `GPU-…-000000000000` upwards, `/dev/nvidia<i>`, four to a NUMA node.
    pub fn new(count: usize) -> (Self, SimulatedControl) {
        let devices = (0..count)
            .map(|i| DeviceInfo {
                id: simulated_uuid(i),
                numa_node: i64::try_from(i / GPUS_PER_NUMA_NODE).ok(),
                device_nodes: vec![PathBuf::from(format!("/dev/nvidia{i}"))],
            })
            .collect();
        let (tx, control) = mpsc::channel(64);
        (SimulatedGpus { devices, control }, SimulatedControl { tx })
    }
}

/// UUID of simulated GPU `index`, in the shape NVML reports (`GPU-` and a version-4-looking UUID).
pub fn simulated_uuid(index: usize) -> String {
    format!("GPU-5133a6b0-51e0-4c1d-9a7e-{index:012x}")
}

impl DeviceSource for SimulatedGpus {
    fn discover(&mut self) -> Result<Vec<DeviceInfo>, SourceError> {
        Ok(self.devices.clone())
    }

    fn start(self: Box<Self>, events: mpsc::Sender<DeviceEvent>) -> Result<(), SourceError> {
        let mut control = self.control;
        tokio::spawn(async move {
            while let Some(event) = control.recv().await {
                if events.send(event).await.is_err() {
                    break;
                }
            }
        });
        Ok(())
    }
}

impl SimulatedControl {
    /// Marks a device Unhealthy with `reason`, as a fault would.
    pub async fn fail(&self, id: &str, reason: &str) {
        self.send(DeviceEvent::Health {
            id: id.into(),
            health: Health::Unhealthy,
            reason: reason.into(),
        })
        .await;
    }

    /// Marks a device Healthy again.
    pub async fn recover(&self, id: &str) {
        self.send(DeviceEvent::Health {
            id: id.into(),
            health: Health::Healthy,
            reason: String::new(),
        })
        .await;
    }

    /// Sends any event. Dropped silently once the plugin has stopped, as a real fault would be.
    pub async fn send(&self, event: DeviceEvent) {
        let _stopped = self.tx.send(event).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simulated_gpus_have_distinct_ids_nodes_and_numa() {
        let (mut gpus, _control) = SimulatedGpus::new(8);
        let devices = gpus.discover().unwrap_or_default();
        let ids: std::collections::HashSet<_> = devices.iter().map(|d| d.id.clone()).collect();
        assert_eq!(ids.len(), 8);
        assert_eq!(devices[3].numa_node, Some(0));
        assert_eq!(devices[4].numa_node, Some(1));
        assert_eq!(devices[5].device_nodes, vec![PathBuf::from("/dev/nvidia5")]);
    }
}
