//! Simulated GPUs: a device source that needs no hardware, so the plugin can be tried and tested anywhere.
//! Faults reach the same health engine as NVML events do, from a fault script file (see [`super::script`])
//! or, in tests, from a [`SimulatedControl`].

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use tokio::sync::mpsc;

use super::script::{self, Command, Line};
use super::{DeviceEvent, DeviceSource, SourceError};
use crate::devices::facts::DeviceFacts;
use crate::devices::{DeviceInfo, Unserved};
use crate::health::{Observation, ProbeResult};

/// Devices per simulated NUMA node, so that simulated nodes exercise NUMA-aware preferred allocation the way a
/// dual-socket GPU server does (four GPUs on each socket).
const GPUS_PER_NUMA_NODE: usize = 4;

/// A fixed set of simulated GPUs with deterministic UUIDs.
pub struct SimulatedGpus {
    devices: Vec<DeviceInfo>,
    unserved: Vec<Unserved>,
    control: mpsc::Receiver<DeviceEvent>,
    script: Option<PathBuf>,
}

/// Injects observations into a running [`SimulatedGpus`] source, as the GPU would.
#[derive(Clone)]
pub struct SimulatedControl {
    tx: mpsc::Sender<DeviceEvent>,
}

impl SimulatedGpus {
    /// `count` GPUs: `GPU-…-000000000000` upwards, `/dev/nvidia<i>`, four to a NUMA node, each with the facts
    /// of an H100 ([`simulated_facts`]).
    pub fn new(count: usize) -> (Self, SimulatedControl) {
        let devices = (0..count)
            .map(|i| DeviceInfo {
                id: simulated_uuid(i),
                numa_node: i64::try_from(i / GPUS_PER_NUMA_NODE).ok(),
                device_nodes: vec![PathBuf::from(format!("/dev/nvidia{i}"))],
                index: Some(i.to_string()),
                mig: None,
                facts: Some(Arc::new(simulated_facts(i))),
            })
            .collect();
        let (tx, control) = mpsc::channel(64);
        let gpus = SimulatedGpus {
            devices,
            unserved: Vec::new(),
            control,
            script: None,
        };
        (gpus, SimulatedControl { tx })
    }

    /// Leaves GPU `index` out of what is served, as a node does with a GPU it finds but cannot serve; the
    /// source reports it as unserved with `why`.
    pub fn leave_unserved(mut self, index: usize, why: &str) -> Self {
        let id = simulated_uuid(index);
        if let Some(position) = self.devices.iter().position(|d| d.id == id) {
            self.devices.remove(position);
            self.unserved.push(Unserved {
                index: Some(index),
                id: Some(id),
                why: why.into(),
            });
        }
        self
    }

    /// Also follows the fault script at `path` (created if missing): each command appended to it becomes an
    /// observation on the named GPU.
    pub fn with_fault_script(mut self, path: &Path) -> Self {
        self.script = Some(path.to_owned());
        self
    }
}

/// UUID of simulated GPU `index`, in the shape NVML reports (`GPU-` and a version-4-looking UUID).
pub fn simulated_uuid(index: usize) -> String {
    format!("GPU-5133a6b0-51e0-4c1d-9a7e-{index:012x}")
}

/// What simulated GPU `index` says about itself: an H100 80GB HBM3 on a 580 driver, minor number `index`,
/// at PCI address `<index / 256>:<index % 256>:00.0` (distinct for every GPU), the four GPUs of a NUMA node
/// under one root complex, named for the bus of the first of them.
pub fn simulated_facts(index: usize) -> DeviceFacts {
    let (domain, bus) = (index / 256, index % 256);
    let root_bus = bus - bus % GPUS_PER_NUMA_NODE;
    DeviceFacts {
        minor: u32::try_from(index).ok(),
        product_name: Some("NVIDIA H100 80GB HBM3".into()),
        brand: Some("Nvidia".into()),
        architecture: Some("Hopper".into()),
        cuda_compute_capability: Some((9, 0)),
        memory_bytes: Some(81559 * 1024 * 1024),
        pci_bus_id: Some(format!("{domain:04x}:{bus:02x}:00.0")),
        pcie_root: Some(format!("pci{domain:04x}:{root_bus:02x}")),
        driver_version: Some("580.65.06".into()),
        cuda_driver_version: Some("13.0".into()),
        mig: None,
    }
}

/// What a simulated GPU reports for a fault command. `restore` has no event of its own: a GPU that answers
/// again is noticed by probing, not by an event; `action` is announced by XID 154, as the driver does.
pub fn observation_for(command: &Command) -> Option<Observation> {
    match command {
        Command::Xid { xid, .. } => Some(Observation::Xid(*xid)),
        Command::Dbe { .. } => Some(Observation::DoubleBitEcc),
        Command::Sbe { .. } => Some(Observation::SingleBitEcc),
        Command::Lost { .. } => Some(Observation::GpuLost),
        // The driver announces a new recovery action with XID 154.
        Command::Action { .. } => Some(Observation::Xid(154)),
        Command::Restore { .. } => None,
    }
}

/// What the fault script says about each GPU now: lost or not, and the driver's recovery action.
#[derive(Debug, Default)]
struct GpuStates {
    lost: HashSet<String>,
    recovery_action: HashMap<String, u32>,
}

impl GpuStates {
    fn apply(&mut self, command: &Command) {
        match command {
            Command::Lost { uuid } => {
                self.lost.insert(uuid.clone());
            }
            Command::Restore { uuid } => {
                self.lost.remove(uuid);
            }
            Command::Action { uuid, action } => {
                self.recovery_action.insert(uuid.clone(), *action);
            }
            _ => {}
        }
    }

    fn probe(&self, id: &str) -> ProbeResult {
        if self.lost.contains(id) {
            ProbeResult::Lost
        } else {
            ProbeResult::Answered {
                recovery_action: Some(self.recovery_action.get(id).copied().unwrap_or(0)),
            }
        }
    }
}

fn lock(states: &Mutex<GpuStates>) -> MutexGuard<'_, GpuStates> {
    states
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl DeviceSource for SimulatedGpus {
    fn discover(&mut self) -> Result<Vec<DeviceInfo>, SourceError> {
        Ok(self.devices.clone())
    }

    fn unserved(&self) -> Vec<Unserved> {
        self.unserved.clone()
    }

    fn start(
        self: Box<Self>,
        events: mpsc::Sender<DeviceEvent>,
        mut probes: mpsc::Receiver<Vec<String>>,
    ) -> Result<(), SourceError> {
        let states = Arc::new(Mutex::new(GpuStates::default()));
        if let Some(path) = &self.script {
            let tx = events.clone();
            let script_states = states.clone();
            let follower = script::follow(path, move |line| {
                let (text, appended) = match line {
                    Line::Existing(text) => (text, false),
                    Line::Appended(text) => (text, true),
                };
                match script::parse_line(text) {
                    Ok(Some(command)) => {
                        lock(&script_states).apply(&command);
                        // History sets state; only appended commands are new faults.
                        if let (true, Some(observation)) = (appended, observation_for(&command)) {
                            let _stopped = tx.blocking_send(DeviceEvent::Observed {
                                id: command.uuid().to_string(),
                                observation,
                                at: SystemTime::now(),
                            });
                        }
                    }
                    Ok(None) => {}
                    Err(e) => tracing::warn!(error = %e, "skipped a fault script line"),
                }
            })
            .map_err(|e| {
                SourceError::Discovery(format!(
                    "cannot follow fault script {}: {e}",
                    path.display()
                ))
            })?;
            tracing::info!(script = %follower.path().display(), "simulated GPUs follow this fault script");
            // The follower lives as long as the event channel: it stops when the plugin does.
            let events_closed = events.clone();
            tokio::spawn(async move {
                events_closed.closed().await;
                drop(follower);
            });
        }
        let probe_events = events.clone();
        tokio::spawn(async move {
            while let Some(ids) = probes.recv().await {
                let answers: Vec<_> = {
                    let states = lock(&states);
                    ids.into_iter().map(|id| (states.probe(&id), id)).collect()
                };
                for (result, id) in answers {
                    let event = DeviceEvent::Observed {
                        id,
                        observation: Observation::Probe(result),
                        at: SystemTime::now(),
                    };
                    if probe_events.send(event).await.is_err() {
                        return;
                    }
                }
            }
        });
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
    /// Reports `observation` on device `id` now.
    pub async fn observe(&self, id: &str, observation: Observation) {
        self.send(DeviceEvent::Observed {
            id: id.into(),
            observation,
            at: SystemTime::now(),
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

    #[test]
    fn simulated_gpus_have_an_h100s_facts_their_minor_and_a_pci_address_each() {
        let (mut gpus, _control) = SimulatedGpus::new(300);
        let devices = gpus.discover().unwrap_or_default();
        let facts: Vec<&DeviceFacts> = devices.iter().filter_map(|d| d.facts.as_deref()).collect();
        assert_eq!(facts.len(), 300, "every simulated GPU has facts");
        for (i, f) in facts.iter().enumerate() {
            assert_eq!(f.minor, u32::try_from(i).ok());
            assert_eq!(f.product_name.as_deref(), Some("NVIDIA H100 80GB HBM3"));
            assert_eq!(
                (f.architecture.as_deref(), f.cuda_compute_capability),
                (Some("Hopper"), Some((9, 0)))
            );
            // In the form the standard attribute takes, so a slice built from it is valid.
            let bus_id = f.pci_bus_id.as_deref().unwrap_or_default();
            assert_eq!(
                crate::devices::facts::pci_bus_id(bus_id).as_deref(),
                Some(bus_id)
            );
        }
        let bus_ids: HashSet<_> = facts.iter().map(|f| f.pci_bus_id.clone()).collect();
        assert_eq!(bus_ids.len(), 300, "distinct PCI addresses");
        assert_eq!(facts[257].pci_bus_id.as_deref(), Some("0001:01:00.0"));
        assert_eq!(
            (facts[4].pcie_root.as_deref(), facts[7].pcie_root.as_deref()),
            (Some("pci0000:04"), Some("pci0000:04")),
            "a NUMA node's GPUs share a root"
        );
        assert_ne!(facts[3].pcie_root, facts[4].pcie_root);
    }

    #[tokio::test]
    async fn appended_fault_commands_become_observations() -> Result<(), Box<dyn std::error::Error>>
    {
        let dir = tempfile::tempdir()?;
        let script = dir.path().join("faults");
        std::fs::write(&script, format!("xid {} 79\n", simulated_uuid(0)))?;
        let (gpus, _control) = SimulatedGpus::new(2);
        let (tx, mut rx) = mpsc::channel(8);
        let (_probe_tx, probe_rx) = mpsc::channel(1);
        Box::new(gpus.with_fault_script(&script)).start(tx, probe_rx)?;
        let line = format!("bogus line\ndbe {}\n", simulated_uuid(1));
        std::fs::OpenOptions::new()
            .append(true)
            .open(&script)
            .and_then(|mut f| {
                use std::io::Write;
                f.write_all(line.as_bytes())
            })?;
        let event = tokio::time::timeout(std::time::Duration::from_secs(5), rx.recv()).await?;
        // The line that was there before start is history, the bogus line is skipped, the DBE arrives.
        let Some(DeviceEvent::Observed {
            id, observation, ..
        }) = event
        else {
            panic!("expected an observation, got {event:?}");
        };
        assert_eq!(
            (id, observation),
            (simulated_uuid(1), Observation::DoubleBitEcc)
        );
        Ok(())
    }
}
